"""Settings and counters of ``rankscope serve`` (one config dataclass, defaults here only).

The counters are plain integers and dicts the loop bumps once per batch (never
per record); the progress line and the metrics endpoint read them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from rankscope.pipeline.bus.kafka import KafkaBus
from rankscope.pipeline.serve.alerts import AlertConfig
from rankscope.pipeline.serve.histogram import (
    LATENCY_BUCKETS_S,
    STEP_BUCKETS,
    WRITE_BUCKETS_S,
    Buckets,
)

__all__ = ["ServeConfig", "ServeStats", "DEAD_REASONS", "dead_reason"]


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """One ``serve`` process."""

    bus: str
    """``kafka://`` URL (see ``rankscope.collectors.schema.kafka``)."""
    db_path: str
    """DuckDB file for findings, scores, checkpoints and dead letters."""
    group: str = "rankscope-serve"
    """Kafka consumer group; processes of one group split the partitions (jobs)."""
    partitions: int = 4
    """Partitions of topics the service creates when they are missing."""
    poll_timeout_s: float = 0.1
    """Longest one poll waits for messages; also the tick period when idle."""
    max_poll_messages: int = 500
    """Most messages taken in one poll (a message may hold many records)."""
    checkpoint_interval_s: float = 5.0
    """How often engine state and offsets are saved and committed (Kafka's own auto-commit
    default; a checkpoint writes megabytes of detector state for a large job, and a
    restart re-reads at most this much telemetry)."""
    session_timeout_s: float = 10.0
    """A ``serve`` silent this long (crashed) loses its partitions to the others of its group."""
    control_secret: bytes | None = None
    """Shared secret signing control messages; ``None``: no control messages (logged)."""
    share_db: bool = False
    """Open the DuckDB file only while writing, so several ``serve`` processes can share it."""
    idle_exit_s: float | None = None
    """Finish (flushing open steps) after this long without a message (replays, benchmarks)."""
    measure_latency: bool = False
    """Record every step's detection latency in the stats (benchmarks)."""
    decode_workers: int = 1
    """Processes that decode large telemetry batches beside the loop (a second core;
    ``rankscope.pipeline.bus.decode_pool``), started with the service and used for
    batches of 512 KiB or more; 0: the loop decodes everything itself."""
    feed_records: int = 4096
    """Records handed to the engine at once: larger amortizes, smaller detects sooner."""
    store_interval_s: float = 0.5
    """Updated findings are stored and published at most this often (each store is a
    DuckDB commit, a disk sync); an evict/recover to announce, a dead letter or a
    checkpoint writes at once, and a checkpoint always follows the findings before it."""
    progress_interval_s: float | None = 30.0
    """A progress line (records/s, lag, open incidents, dead letters) this often; None: never."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free one, logged); None: no endpoint."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds (``0.0.0.0`` to be scraped from other hosts)."""
    alerts: AlertConfig | None = None
    """Webhooks told of every evict/recover finding (``rankscope.pipeline.serve.alerts``)."""

    def __post_init__(self) -> None:
        KafkaBus(self.bus)  # raises ValueError with the reason
        if not self.db_path:
            raise ValueError("serve: db_path must not be empty")
        if not self.group:
            raise ValueError("serve: group must not be empty")
        if self.partitions < 1:
            raise ValueError(f"serve: partitions must be >= 1, got {self.partitions}")
        if self.poll_timeout_s <= 0 or self.checkpoint_interval_s <= 0:
            raise ValueError("serve: poll_timeout_s and checkpoint_interval_s must be > 0")
        if not 6.0 <= self.session_timeout_s <= 300.0:  # the broker's default bounds
            raise ValueError(f"serve: session_timeout_s={self.session_timeout_s} not in 6..300")
        if not 0 <= self.decode_workers <= 64:
            raise ValueError(f"serve: decode_workers={self.decode_workers} not in 0..64")
        if self.max_poll_messages < 1 or self.feed_records < 1:
            raise ValueError("serve: max_poll_messages and feed_records must be >= 1")
        if self.store_interval_s < 0:
            raise ValueError(f"serve: store_interval_s must be >= 0, got {self.store_interval_s}")
        if self.idle_exit_s is not None and self.idle_exit_s <= 0:
            raise ValueError("serve: idle_exit_s must be > 0")
        if self.progress_interval_s is not None and self.progress_interval_s <= 0:
            raise ValueError("serve: progress_interval_s must be > 0 (None: no progress lines)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"serve: metrics_port={self.metrics_port} not in 0..65535")
        if not self.metrics_host:
            raise ValueError("serve: metrics_host must not be empty")


DEAD_REASONS = ("message", "record", "wrong_topic", "engine", "store")
"""Dead-letter classes (the metric's ``reason`` label; the full reason is in the store)."""


def dead_reason(reason: str, index: int) -> str:
    """The class of a dead letter: a whole message that is not records, one record
    that breaks the schema, a record on the wrong topic, the engine or the store failing."""
    if reason.startswith("engine error"):
        return "engine"
    if reason.startswith("store:"):
        return "store"
    if "on the gpu topic" in reason:
        return "wrong_topic"
    return "message" if index < 0 else "record"


@dataclass(slots=True)
class ServeStats:
    """What one ``run`` did."""

    messages: int = 0
    records: int = 0
    deadletters: int = 0
    findings: int = 0
    control_sent: int = 0
    checkpoints: int = 0
    engine_errors: int = 0
    """Steps dropped because building or detecting them raised (the service went on)."""
    seconds: float = 0.0
    detect_latency_s: list[float] = field(default_factory=list)
    """Per finding: from the arrival of its detected step's last record to the finding."""
    step_latency_s: list[float] = field(default_factory=list)
    """Per step (with ``measure_latency``): from its last record's arrival to detection."""
    busy_s: float = 0.0
    """From the first message received to the end of processing the last one."""
    partition_records: dict[int, int] = field(default_factory=dict)
    """Records processed per partition number (which jobs this process served)."""
    store_lag_s: float | None = None
    """(``measure_latency``) From the end of processing the last message to the end of
    the first write handed over after it: when everything read was stored."""
    records_in: dict[tuple[str, int, str], int] = field(default_factory=dict)
    """Records fed to the engine per (topic, partition, path: ``columns`` or ``records``)."""
    dead_by_reason: dict[str, int] = field(default_factory=dict)
    """Dead letters per class (``dead_reason``)."""
    findings_by: dict[tuple[str, str], int] = field(default_factory=dict)
    """Findings per (kind, action), counted once per finding and action it reached."""
    control_by_action: dict[str, int] = field(default_factory=dict)
    """Control messages published per action."""
    finding_latency_s: Buckets = field(default_factory=lambda: Buckets(LATENCY_BUCKETS_S))
    """From the arrival of a finding's detected step's last record to the finding."""
    record_to_finding_s: Buckets = field(default_factory=lambda: Buckets(LATENCY_BUCKETS_S))
    """From the record time of a finding's detected step (the trainer's clock) to the finding."""
    delay_steps: dict[str, Buckets] = field(default_factory=dict)
    """Per kind: steps from an incident's onset (first step) to its detection."""
    write_s: dict[str, Buckets] = field(default_factory=dict)
    """Per write kind (``turn``, ``checkpoint``): how long the writer took to store it."""
    _first: float | None = None

    def count_records(self, topic: str, partition: int, n: int, path: str) -> None:
        """``n`` records of one batch fed to the engine (the loop's one counter call)."""
        self.records += n
        counts = self.partition_records
        counts[partition] = counts.get(partition, 0) + n
        key = (topic, partition, path)
        self.records_in[key] = self.records_in.get(key, 0) + n

    def dead_letter(self, reason: str, index: int = -1) -> None:
        self.deadletters += 1
        cls = dead_reason(reason, index)
        self.dead_by_reason[cls] = self.dead_by_reason.get(cls, 0) + 1

    def sent_control(self, action: str) -> None:
        self.control_sent += 1
        self.control_by_action[action] = self.control_by_action.get(action, 0) + 1

    def observe_write(self, seconds: float, *, checkpoint: bool) -> None:
        what = "checkpoint" if checkpoint else "turn"
        hist = self.write_s.get(what)
        if hist is None:
            hist = self.write_s[what] = Buckets(WRITE_BUCKETS_S)
        hist.observe(seconds)

    def observe_delay(self, kind: str, steps: int) -> None:
        hist = self.delay_steps.get(kind)
        if hist is None:
            hist = self.delay_steps[kind] = Buckets(STEP_BUCKETS)
        hist.observe(steps)

    def summary(self) -> str:
        rate = self.records / self.seconds if self.seconds > 0 else 0.0
        lat = ""
        if self.detect_latency_s:
            lat += f", median finding latency {statistics.median(self.detect_latency_s):.3f} s"
        if self.step_latency_s:
            lat += f", median step latency {statistics.median(self.step_latency_s):.3f} s"
        return (
            f"{self.records} records in {self.messages} messages ({rate:,.0f} records/s), "
            f"{self.findings} finding updates, {self.control_sent} control messages, "
            f"{self.deadletters} dead letters{lat}; records by partition "
            f"{dict(sorted(self.partition_records.items()))}"
        )

"""Settings and counters of ``rankscope serve`` (one config dataclass, defaults here only)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from rankscope.pipeline.bus.kafka import KafkaBus

__all__ = ["ServeConfig", "ServeStats"]


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
    feed_records: int = 4096
    """Records handed to the engine at once: larger amortizes, smaller detects sooner."""
    store_interval_s: float = 0.5
    """Updated findings are stored and published at most this often (each store is a
    DuckDB commit, a disk sync); an evict/recover to announce, a dead letter or a
    checkpoint writes at once, and a checkpoint always follows the findings before it."""

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
        if self.max_poll_messages < 1 or self.feed_records < 1:
            raise ValueError("serve: max_poll_messages and feed_records must be >= 1")
        if self.store_interval_s < 0:
            raise ValueError(f"serve: store_interval_s must be >= 0, got {self.store_interval_s}")
        if self.idle_exit_s is not None and self.idle_exit_s <= 0:
            raise ValueError("serve: idle_exit_s must be > 0")


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
    _first: float | None = None

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

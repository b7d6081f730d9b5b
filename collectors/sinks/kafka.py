"""The Kafka sink: telemetry from a training rank to ``<prefix>.telemetry`` / ``.gpu``.

``sink="kafka://host:9092[,host2:9092]?acks=all&linger_ms=50&compression=gzip"``

Training must never wait for Kafka. ``send`` only appends to a bounded buffer
and returns; a thread of the sink owns the kafka-python producer, creates it
(again and again, with backoff, while no broker answers), and hands it the
buffered records. The bound covers the buffer plus the records the producer
holds unacknowledged, so a dead broker costs at most ``buffer_records``
records of memory; beyond that new records are dropped and counted. The next
``step`` or ``beat`` record that gets into the buffer carries the count in its
``dropped`` field (the trace format's "records dropped since the last record"),
so the service sees the gap. A count never gets lost with the record carrying
it: a dropped record's own ``dropped`` (stamped by the collector's sender), and
the counts inside a batch whose delivery failed, are carried on as well. The
producer reconnects by itself; records it held through a short outage are
delivered when the broker is back.

Wire format: the message key is the job (UTF-8), so one job's records stay in
order in one partition; the value is one JSON record, or a JSON array of
records of that job when one ``send`` call carried several (a step record and
the beats around it share one message; consumers accept both shapes).

URL options (besides those of ``rankscope.collectors.schema.kafka``):
``acks`` (``1``, ``all`` or ``0``; default 1), ``linger_ms`` (default 50),
``compression`` (``lz4`` default, ``gzip``, ``zstd``, ``snappy`` or ``none``; a codec
whose Python package is missing falls back to gzip), ``buffer_records`` (default 50000),
``flush_timeout_s`` (default 5).

kafka-python's warning that a step of its event loop took over 0.1 s is
counted (``stats()["client_slow_loops"]``), not printed into the training log,
for this sink's producers only: beside a training loop that holds the GIL it
is load, not a fault.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass

from rankscope.collectors.schema.kafka import (
    COMPRESSIONS,
    DEFAULT_COMPRESSION,
    SLOW_LOOP_LOGGER,
    KafkaUrl,
    compression_type,
    idempotence_kwargs,
    is_slow_client_loop,
    topic_for_record,
)

__all__ = ["KafkaSink", "KafkaSinkConfig"]

log = logging.getLogger(__name__)


class _QuietSlowLoops(logging.Filter):
    """Counts and drops the client's slow-loop warnings from the sinks' threads.

    Those are the sink's own thread and the producer's network thread, whose
    name kafka-python builds from the client id; other clients in the process
    (the service's, a user's own) keep their warnings.
    """

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName in self.threads and is_slow_client_loop(record):
            self.count += 1
            return False
        return True


_QUIET = _QuietSlowLoops()
_SINKS = itertools.count()
logging.getLogger(SLOW_LOOP_LOGGER).addFilter(_QUIET)


@dataclass(kw_only=True, slots=True)
class KafkaSinkConfig:
    """How the sink talks to the brokers; every field comes from the URL."""

    acks: str = "1"
    """Broker acknowledgement: ``0``, ``1`` (leader) or ``all`` (every in-sync replica)."""
    linger_ms: int = 50
    """How long the producer waits to fill a batch; larger batches, fewer requests."""
    compression: str = DEFAULT_COMPRESSION
    """Batch compression codec (``rankscope.collectors.schema.kafka``), ``none`` to turn it off."""
    buffer_records: int = 50_000
    """Most records held while the broker is slow or away (buffer + unacknowledged)."""
    flush_timeout_s: float = 5.0
    """Longest ``flush``/``close`` waits for delivery before giving up (and counting)."""
    reconnect_backoff_s: float = 0.5
    """Pause between attempts to create the producer while no broker answers."""

    def __post_init__(self) -> None:
        if self.acks not in ("0", "1", "all"):
            raise ValueError(f"kafka sink: acks={self.acks!r}; want 0, 1 or all")
        if not 0 <= self.linger_ms <= 60_000:
            raise ValueError(f"kafka sink: linger_ms={self.linger_ms} outside 0..60000")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"kafka sink: compression={self.compression!r}; want one of {COMPRESSIONS}"
            )
        if self.buffer_records < 1:
            raise ValueError(f"kafka sink: buffer_records={self.buffer_records} must be >= 1")
        if self.flush_timeout_s < 0:
            raise ValueError(f"kafka sink: flush_timeout_s={self.flush_timeout_s} is negative")
        if self.reconnect_backoff_s <= 0:
            raise ValueError("kafka sink: reconnect_backoff_s must be > 0")


def _carried(rec: dict) -> int:
    """The drop count a record carries (``dropped`` of a step or beat record)."""
    if rec.get("type") not in ("step", "beat"):
        return 0
    n = rec.get("dropped")
    return n if type(n) is int and n > 0 else 0


class KafkaSink:
    """Bounded, non-blocking producer of trace records (see the module docstring)."""

    def __init__(self, url: KafkaUrl, cfg: KafkaSinkConfig) -> None:
        self.url = url
        self.cfg = cfg
        # (topic, job, value, records, drop counts the records carry)
        self._buf: collections.deque[tuple[str, str, bytes, int, int]] = collections.deque()
        self._buffered = 0  # records in _buf
        self._inflight = 0  # records handed to the producer, not yet acked or failed
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._unreported_drops = 0
        self.sent = 0  # records acknowledged by the broker
        self.dropped = 0  # records given up: buffer full, delivery failed, unsendable
        self.errors = 0  # delivery / producer errors seen
        self.connected = False
        self._last_ack_t = 0.0
        self._producer = None
        self._thread = threading.Thread(
            target=self._run, name=f"rankscope-kafka-sink-{next(_SINKS)}", daemon=True
        )
        _QUIET.threads.add(self._thread.name)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str) -> KafkaSink:
        parsed = KafkaUrl.parse(url)
        known = {"acks", "linger_ms", "compression", "buffer_records", "flush_timeout_s"}
        unknown = sorted(set(parsed.options) - known)
        if unknown:
            raise ValueError(f"kafka sink URL: unknown option(s) {unknown}; known: {sorted(known)}")
        cfg = KafkaSinkConfig(
            acks=parsed.option("acks", "1"),
            linger_ms=parsed.option("linger_ms", 50, int),
            compression=parsed.option("compression", DEFAULT_COMPRESSION),
            buffer_records=parsed.option("buffer_records", 50_000, int),
            flush_timeout_s=float(parsed.option("flush_timeout_s", "5")),
        )
        return cls(parsed, cfg)

    # -- called by the collector's sender thread; never blocks on the network --

    def send(self, records: list[dict]) -> None:
        groups: dict[tuple[str, str], list[dict]] = {}
        with self._lock:
            if self._closed:
                raise RuntimeError("kafka sink is closed")
            room = self.cfg.buffer_records - self._buffered - self._inflight
            for rec in records:
                if room <= 0:
                    self.dropped += 1
                    self._unreported_drops += 1 + _carried(rec)
                    continue
                room -= 1
                if self._unreported_drops and rec.get("type") in ("step", "beat"):
                    rec = {**rec, "dropped": int(rec.get("dropped") or 0) + self._unreported_drops}
                    self._unreported_drops = 0
                kind = topic_for_record(rec)
                groups.setdefault((kind, str(rec.get("job", ""))), []).append(rec)
            for (kind, job), recs in groups.items():
                body = recs[0] if len(recs) == 1 else recs
                value = json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
                carried = sum(map(_carried, recs))
                self._buf.append((self.url.topic(kind), job, value, len(recs), carried))
                self._buffered += len(recs)
            if groups:
                self._wake.notify()

    def flush(self) -> None:
        """Wait (at most ``flush_timeout_s``) until everything buffered is acknowledged.

        Returns at once while no broker answers: the sink's own thread keeps
        delivering, and the caller (the collector's sender) has records to take."""
        deadline = time.monotonic() + self.cfg.flush_timeout_s
        with self._lock:
            self._wake.notify()
            while (
                (self._buffered or self._inflight) and self._healthy() and not self._closed_thread()
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, 0.05))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
        deadline = time.monotonic() + self.cfg.flush_timeout_s
        with self._lock:  # a last chance to deliver, even if the broker was away
            self._wake.notify()
            while (self._buffered or self._inflight) and not self._closed_thread():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, 0.05))
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=self.cfg.flush_timeout_s + 2.0)
        with self._lock:
            # Whatever is still here could not be delivered in time.
            if self._buffered or self._inflight:
                lost = self._buffered + self._inflight
                log.warning("kafka sink closed with %d records undelivered", lost)
                self.dropped += lost
                self._buffered = self._inflight = 0
                self._buf.clear()

    def stats(self) -> dict:
        with self._lock:
            return {
                "sent": self.sent,
                "dropped": self.dropped,
                "errors": self.errors,
                "buffered": self._buffered,
                "inflight": self._inflight,
                "connected": self.connected,
                "client_slow_loops": _QUIET.count,
            }

    # -- the sink's own thread --

    def _closed_thread(self) -> bool:
        return not self._thread.is_alive()

    def _healthy(self) -> bool:
        """The broker acknowledged something lately (or there is nothing to acknowledge)."""
        return self._producer is not None and (
            self._inflight == 0 or time.monotonic() - self._last_ack_t < 2.0
        )

    def _make_producer(self):
        from kafka import KafkaProducer  # heavy import, only when Kafka is really used

        cfg = self.cfg
        acks = "all" if cfg.acks == "all" else int(cfg.acks)
        producer = KafkaProducer(
            **self.url.client_kwargs(),
            **idempotence_kwargs(acks, KafkaProducer.DEFAULT_CONFIG),
            acks=acks,
            linger_ms=cfg.linger_ms,
            compression_type=compression_type(cfg.compression),
            max_block_ms=200,
            bootstrap_timeout_ms=2000,
            reconnect_backoff_ms=100,
            reconnect_backoff_max_ms=1000,
            retries=2**31 - 1,
            delivery_timeout_ms=120_000,
            request_timeout_ms=self.url.client.get("request_timeout_ms", 10_000),
        )
        cid = str(producer.config["client_id"])
        _QUIET.threads.update(t.name for t in threading.enumerate() if cid in t.name)
        return producer

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._buf and not self._closed:
                    self._wake.wait(0.5)
                closing = self._closed
            if closing:
                if self._producer is not None:
                    self._drain()  # one last hand-over; producer.close() below delivers
                break
            if self._producer is None:
                try:
                    self._producer = self._make_producer()
                    self.connected = True
                except Exception as exc:  # noqa: BLE001 - no broker yet: keep buffering
                    self._note_error("cannot reach Kafka %s: %s", self.url.redacted(), exc)
                    with self._lock:
                        if self._closed:
                            break
                        self._wake.wait(self.cfg.reconnect_backoff_s)
                    continue
            self._drain()
        if self._producer is not None:
            try:
                self._producer.close(timeout=self.cfg.flush_timeout_s)
            except Exception as exc:  # noqa: BLE001
                self._note_error("closing the Kafka producer: %s", exc)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._buf:
                    return
                topic, job, value, n, carried = self._buf.popleft()
                self._buffered -= n
                self._inflight += n
            try:
                fut = self._producer.send(topic, key=job.encode(), value=value)
            except Exception as exc:  # noqa: BLE001 - buffer full or metadata missing
                with self._lock:
                    self._inflight -= n
                    self._buf.appendleft((topic, job, value, n, carried))
                    self._buffered += n
                self._note_error("Kafka producer not accepting records: %s", exc)
                with self._lock:
                    if not self._closed:
                        self._wake.wait(self.cfg.reconnect_backoff_s)
                    else:
                        return
                continue
            fut.add_callback(self._acked, n)
            fut.add_errback(self._failed, n, carried)

    def _acked(self, n: int, _metadata) -> None:
        with self._lock:
            self._inflight -= n
            self.sent += n
            self.connected = True
            self._last_ack_t = time.monotonic()
            self._wake.notify_all()

    def _failed(self, n: int, carried: int, exc) -> None:
        with self._lock:
            self.connected = False
            self._inflight -= n
            self.dropped += n
            self._unreported_drops += n + carried
            self._wake.notify_all()
        self._note_error("Kafka delivery failed, %d records dropped: %s", n, exc)

    def _note_error(self, fmt: str, *args) -> None:
        """Count every error, log the first and then one in a hundred."""
        with self._lock:
            self.errors += 1
            count = self.errors
        if count == 1 or count % 100 == 0:
            log.warning(fmt + " (error %d)", *args, count)

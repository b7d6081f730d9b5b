"""Consumer lag per partition, and what ``serve`` does about it.

The lag (messages between what was read and the high watermark of the last
fetch) serves three ends: the progress line and the metrics report it;
``StreamClock`` holds a partition's clock still while it has a backlog (a
rank whose records are still in the backlog is not silent, however long the
backlog takes to read); and ``GpuAligner`` holds a partition's telemetry back
while its GPU samples lag behind, as follows.

Telemetry and GPU samples of one job travel on two topics; a consumer that
finds a backlog on both (a restart, a trace published before ``serve`` came
up) may read all the steps before the first sample, and the engine would then
build every step without its GPU readings, where replay (sorted by time) has
them. So while partition *i* of ``<prefix>.gpu`` has messages not read yet (up to
its high watermark at the last fetch), partition *i* of ``<prefix>.telemetry`` is
paused;
from assignment until the GPU partition's first fetch too. A hold ends when
the GPU partition makes no progress for ``HOLD_MAX_S``; telemetry then goes on
regardless for ``COOL_S`` (a GPU topic in trouble must never stall detection).
Live, with both topics caught
up, nothing is held; the watermark then makes complete steps wait for the
samples up to their time (``rankscope.pipeline.engine.watermark``).
"""

from __future__ import annotations

import logging
import time

__all__ = ["GpuAligner", "StreamClock", "partition_lag"]

log = logging.getLogger("rankscope.serve")

HOLD_MAX_S = 2.0
BACKLOG_MESSAGES = 2
"""More messages than this not read yet is a backlog (a prefetch in flight is not)."""
COOL_S = 10.0
TURN_S = 1.0
"""The most one turn of ``serve``'s loop advances a caught-up clock (``DELIVERY_S``)."""


def partition_lag(consumer, tp, next_offset: int | None) -> int | None:
    """Messages of ``tp`` not read yet, from the last fetch's high watermark; None before."""
    hw = consumer.highwater(tp)
    if hw is None or next_offset is None:
        return None
    return max(0, hw - next_offset)


def _read(consumer, tp, part) -> int | None:
    """Offset after the last message read; before any, where the client starts."""
    got = part.next_offset.get(tp.topic)
    if got is not None:
        return got
    try:
        return consumer.position(tp, timeout_ms=0)  # no wait: the client's known position
    except Exception:  # noqa: BLE001 - not known yet: treated as behind, the hold is bounded
        return None


class GpuAligner:
    """Pauses and resumes telemetry partitions (``serve``'s loop calls ``update`` each turn)."""

    def __init__(self, telemetry: str, gpu: str) -> None:
        self.telemetry, self.gpu = telemetry, gpu
        self._held: dict[int, list] = {}  # partition number -> [GPU offset, progress at]
        self._cool: dict[int, float] = {}  # partition number -> no hold before (monotonic)
        self.holds = 0
        # (topic, partition) -> messages not read; None: not known (not fetched yet, or paused)
        self.lag: dict[tuple[str, int], int | None] = {}

    def assigned(self, consumer, numbers) -> None:
        """New partitions: telemetry waits for the GPU partition's first fetch."""
        from kafka.structs import TopicPartition

        now = time.monotonic()
        for p in numbers:
            if p not in self._held:
                consumer.pause(TopicPartition(self.telemetry, p))
                self._held[p] = [None, now]

    def update(self, consumer, parts: dict) -> None:
        from kafka.structs import TopicPartition

        now = time.monotonic()
        for p in [p for p in self._held if p not in parts]:
            del self._held[p]  # revoked: the client forgets its pause with the assignment
        self.lag = {}
        for p, part in parts.items():
            tel_tp = TopicPartition(self.telemetry, p)
            self.lag[(self.telemetry, p)] = partition_lag(consumer, tel_tp,
                                                          _read(consumer, tel_tp, part))
            gpu_tp = TopicPartition(self.gpu, p)
            hw = consumer.highwater(gpu_tp)
            read = _read(consumer, gpu_tp, part) if hw else part.next_offset.get(self.gpu)
            behind = hw is None or hw > (read or 0)
            self.lag[(self.gpu, p)] = None if hw is None else max(0, hw - (read or 0))
            held = self._held.get(p)
            if held is None:
                if behind and hw is not None and now >= self._cool.get(p, 0.0):
                    consumer.pause(tel_tp)
                    self._held[p] = [read, now]
                    self.holds += 1
                continue
            if read != held[0]:
                held[0], held[1] = read, now  # the GPU samples are coming: keep holding
            if not behind or now - held[1] > HOLD_MAX_S:
                if behind:
                    log.info("GPU samples of partition %d stuck for %.0f s: telemetry goes on",
                             p, HOLD_MAX_S)  # fmt: skip
                    self._cool[p] = now + COOL_S
                consumer.resume(tel_tp)
                del self._held[p]


class StreamClock:
    """The clock ``serve`` gives one partition's engine: wall time, less the time spent
    more than ``backlog`` messages behind (or not knowing: paused, not fetched yet),
    and less what of one turn of the loop went past ``turn_s`` (the service was busy:
    a large batch, a checkpoint, a loaded host). The engine decides on record times;
    it asks the wall clock only whether a rank has gone silent
    (``AssemblerConfig.stall_s``), and neither while a backlog is read nor while the
    service itself was too busy to read can anyone be told silent: under load the
    last two messages of a published trace were read seconds apart, and the ranks
    whose last beats came first were named crashed."""

    __slots__ = ("backlog", "turn_s", "_since", "_lost", "_last")

    def __init__(self, backlog: int = BACKLOG_MESSAGES, turn_s: float = TURN_S) -> None:
        self.backlog = backlog
        self.turn_s = turn_s
        self._since: float | None = None
        self._lost = 0.0
        self._last: float | None = None

    def __call__(self, wall: float, lag: int | None) -> float:
        """``lag``: messages of the partition not read yet; None (not known) holds too."""
        if self._last is not None and wall - self._last > self.turn_s and self._since is None:
            self._lost += wall - self._last - self.turn_s  # a busy turn: not silence
        self._last = wall
        if lag is None or lag > self.backlog:
            if self._since is None:
                self._since = wall
            return self._since - self._lost
        if self._since is not None:
            self._lost += wall - self._since
            self._since = None
        return wall - self._lost

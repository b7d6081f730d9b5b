"""Device-correct ``compute_s`` / ``comm_s`` on CUDA: timing events, resolved off-thread.

On a GPU the training thread only launches work, so ``perf_counter`` around a
step measures launches and host syncs. Here the training thread records
timing events on the current (compute) stream instead, never waits for one,
and the sender thread reads their elapsed times once ``query()`` says they
completed (how it is measured and why: docs/collectors.md, Device timing):

* the step's device span: an event at the first forward, one at the boundary;
* a blocked interval per collective: events around the point where the
  compute stream waits for it (a synchronous call, ``Work.wait()``, a
  functional collective's ``wait_tensor``), so the gap is the time the
  stream sat waiting for the peers;
* DDP's tail: the last bucket launch to the latest bucket completion.

``comm_s`` is the blocked time (at most the span) and ``compute_s`` the rest
of the span. A step whose events are not complete ``wait_s`` after it ended,
or that found ``max_pending`` steps still in flight, keeps its CPU times
(counted in ``stats``, said once at WARNING). Events are pooled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceTiming", "StepEvents", "TimingStats", "cuda_events", "make_device_timing"]

log = logging.getLogger("rankscope.collectors")

_MAX_PAIRS = 4096  # blocked intervals per step; past that the step keeps its CPU times


def cuda_events() -> Any:
    """The default event factory: a CUDA timing event (records on the current stream)."""
    import torch

    return torch.cuda.Event(enable_timing=True)


def make_device_timing(cfg: Any, params: list) -> DeviceTiming | None:
    """The collector's device timing per ``CollectorConfig``: on when a parameter
    lives on CUDA (``device_timing=None``), forced on or off otherwise."""
    if cfg.device_timing is False:
        return None
    events = cfg.device_events
    if events is None:
        import torch

        on_cuda = any(getattr(p, "device", None) is not None and p.device.type == "cuda"
                      for p in params)  # fmt: skip
        if not (on_cuda or cfg.device_timing) or not torch.cuda.is_available():
            if cfg.device_timing:
                log.warning("rankscope collector: device_timing=True but CUDA is not "
                            "available; compute_s/comm_s are CPU times")  # fmt: skip
            return None
        events = cuda_events
    return DeviceTiming(
        events=events, wait_s=cfg.device_timing_wait_s, max_pending=cfg.device_timing_max_pending
    )


@dataclass(slots=True)
class TimingStats:
    """What became of the steps' events (sender-thread counters but ``dropped``)."""

    resolved: int = 0
    """Steps whose compute_s / comm_s are device times."""
    fallback: int = 0
    """Steps whose events were not complete within ``wait_s``: CPU times kept."""
    dropped: int = 0
    """Steps not timed on the device: ``max_pending`` steps were still in flight, or
    the step had more than 4096 blocked intervals."""


class StepEvents:
    """One step's events, handed from the training thread to the sender thread."""

    __slots__ = ("start", "end", "pairs", "launch", "done", "closed_at", "finished", "extra")

    def __init__(self, start: Any, end: Any, pairs: list, launch: Any, done: list, at: float):
        self.start, self.end, self.pairs = start, end, pairs
        self.launch, self.done, self.closed_at = launch, done, at
        self.finished = False
        self.extra: list = []  # events to wait for too, not timed (host_copy's copy)

    def events(self) -> list:
        out = [self.start, self.end, *self.done]
        for a, b in self.pairs:
            out += (a, b)
        if self.launch is not None:
            out.append(self.launch)
        return out

    def seconds(self) -> tuple[float, float]:
        """(compute_s, comm_s) from complete events (elapsed_time is in ms)."""
        span = max(0.0, self.start.elapsed_time(self.end) / 1e3)
        blocked = sum(max(0.0, a.elapsed_time(b)) for a, b in self.pairs) / 1e3
        if self.launch is not None and self.done:
            tail = max(self.launch.elapsed_time(d) for d in self.done) / 1e3
            blocked += max(0.0, tail)
        comm = min(blocked, span)
        return span - comm, comm


class DeviceTiming:
    """Records events on the training thread; resolves them on the sender thread."""

    def __init__(
        self,
        *,
        events: Callable[[], Any] = cuda_events,
        wait_s: float = 2.0,
        max_pending: int = 64,
        poll_s: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._new_event = events
        self._wait_s, self._max_pending, self._poll_s = wait_s, max_pending, poll_s
        self._clock, self._sleep = clock, sleep
        self._pool: deque = deque()  # events of resolved steps, reused
        self._in_flight: deque[StepEvents] = deque()
        self.stats = TimingStats()
        self._warned = False
        self._lock = threading.Lock()  # stats written by the sender, read by anyone
        self._clear()

    # ------------------------------------------------------------ training thread

    def _record(self) -> Any:
        """A recorded event; None when recording failed (the step keeps CPU times)."""
        try:
            ev = self._pool.pop() if self._pool else self._new_event()
            ev.record()
            return ev
        except Exception as exc:
            self._overflow = True
            self._fault(exc)
            return None

    def _clear(self) -> None:
        self._start: Any = None
        self._pairs: list = []
        self._launch: Any = None
        self._done: list = []
        self._overflow = False

    def step_begin(self) -> None:
        """The step's first forward: the device span starts here."""
        if self._start is None:
            self._start = self._record()

    def blocked_begin(self) -> Any:
        """Before the compute stream waits for a collective; pass the result to
        ``blocked_end`` once the wait is queued."""
        return self._record()

    def blocked_end(self, begin: Any) -> None:
        if begin is None:
            return
        if len(self._pairs) >= _MAX_PAIRS:
            self._overflow = True
            return
        end = self._record()
        if end is not None:
            self._pairs.append((begin, end))

    def bucket_launched(self) -> None:
        """A DDP bucket's reduction was launched (the last one starts the tail)."""
        old, self._launch = self._launch, self._record()
        if old is not None:
            self._pool.append(old)  # nobody else holds it: reusable at once

    def bucket_done(self) -> None:
        """A DDP bucket's reduction completed (recorded on the stream that waits for it)."""
        if len(self._done) < _MAX_PAIRS:
            ev = self._record()
            if ev is not None:
                self._done.append(ev)

    def step_end(self) -> StepEvents | None:
        """Close the step; None when it keeps its CPU times (counted as dropped)."""
        start, pairs, launch, done, overflow = (
            self._start, self._pairs, self._launch, self._done, self._overflow
        )  # fmt: skip
        self._clear()
        if start is None:  # no forward seen (the loop calls rc.step() only)
            start = self._record()
        self._prune()
        end = None
        if not overflow and len(self._in_flight) < self._max_pending:
            end = self._record()
        if end is None or start is None or self._overflow:
            self._overflow = False
            with self._lock:
                self.stats.dropped += 1
            return None
        ev = StepEvents(start, end, pairs, launch, done, self._clock())
        self._in_flight.append(ev)
        return ev

    def _prune(self) -> None:
        """Forget finished steps and ones the sender never got to (dropped records)."""
        q, now = self._in_flight, self._clock()
        while q and (q[0].finished or now - q[0].closed_at > 4 * self._wait_s + 1.0):
            q.popleft()

    # -------------------------------------------------------------- sender thread

    def resolve(self, ev: StepEvents) -> tuple[float, float] | None:
        """(compute_s, comm_s) in device time, waiting at most until ``wait_s`` after
        the step closed; None (a counted fallback to CPU times) past that."""
        pending = ev.events()
        deadline = ev.closed_at + self._wait_s
        try:
            while not all(e.query() for e in pending + ev.extra):
                if self._clock() >= deadline:
                    self._fallback()
                    return None
                self._sleep(self._poll_s)
            out = ev.seconds()
        except Exception as exc:  # a broken event: this step keeps its CPU times
            self._fallback(exc)
            return None
        finally:
            ev.finished = True
        self._pool.extend(pending)
        with self._lock:
            self.stats.resolved += 1
        return out

    def _fault(self, exc: BaseException) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning(
                "rankscope collector: recording a device timing event failed (%s: %s); "
                "such steps keep their CPU compute_s/comm_s (rc.device_timing.dropped)",
                type(exc).__name__,
                exc,
            )

    def _fallback(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self.stats.fallback += 1
            first, self._warned = not self._warned, True
        if first:
            log.warning(
                "rankscope collector: a step's device timing events did not complete within "
                "%.1f s%s; such steps keep their CPU compute_s/comm_s (counted in "
                "rc.device_timing.fallback)",
                self._wait_s,
                f" ({type(exc).__name__}: {exc})" if exc is not None else "",
            )

"""Bounded queue plus background sender: the only path from a rank to a sink.

The training thread (and the beat thread) only ever append to a bounded deque
under a lock held for microseconds. When the deque is full the OLDEST record
is dropped and counted, never the caller blocked: fresh telemetry matters more
than old telemetry, and training matters more than either. A daemon thread
takes batches, turns lazy items into dicts (so that tensor-to-float
conversions, which may synchronize a GPU, happen off the training thread),
stamps how many records were lost since the last delivered one into the
``dropped`` field of the next step/beat record, and hands the batch to the
sink. Sink errors are logged once, counted, and the batch's records are
counted as dropped; nothing is ever raised back to the producer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Sender", "SenderStats"]

log = logging.getLogger("rankscope.collectors")

# Record types whose schema has a ``dropped`` field.
_STAMPABLE = ("step", "beat")


@dataclass(slots=True)
class SenderStats:
    """Counters since the sender started."""

    enqueued: int = 0
    sent: int = 0
    dropped_queue_full: int = 0
    dropped_send_failed: int = 0
    dropped_bad_item: int = 0
    send_errors: int = 0
    flush_errors: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_send_failed + self.dropped_bad_item


class Sender:
    """Never-blocking producer side, background consumer side, for one sink.

    Items are record dicts or zero-argument callables returning one (resolved
    on the sender thread).
    """

    def __init__(
        self,
        sink: Any,
        *,
        queue_size: int,
        batch_max_records: int,
        flush_interval_s: float,
        send_interval_s: float | None = None,
        name: str = "rankscope-sender",
    ) -> None:
        self._sink = sink
        self._max = queue_size
        self._batch_max = batch_max_records
        self._flush_interval_s = flush_interval_s
        self._send_interval_s = min(send_interval_s or flush_interval_s, flush_interval_s)
        self._wake_at = max(1, min(batch_max_records, queue_size) // 2)
        self._q: deque = deque()
        self._cv = threading.Condition(threading.Lock())
        self._closing = False
        self._closed_sink = False
        self._pending_drops = 0  # lost since the last delivered stampable record
        self._in_flight = 0
        self._logged: set[str] = set()
        self.stats = SenderStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- producer side (training / beat threads) ----

    def put(self, item: dict | Callable[[], dict]) -> None:
        """Enqueue without ever blocking on the sink; drop the oldest when full."""
        with self._cv:
            if self._closing:
                self.stats.dropped_queue_full += 1
                self._pending_drops += 1
                return
            if len(self._q) >= self._max:
                self._q.popleft()
                self.stats.dropped_queue_full += 1
                self._pending_drops += 1
            self._q.append(item)
            self.stats.enqueued += 1
            if len(self._q) == self._wake_at:
                self._cv.notify()

    def pending(self) -> int:
        """Records waiting in the queue or being sent right now."""
        with self._cv:
            return len(self._q) + self._in_flight

    def close(self, timeout_s: float) -> bool:
        """Stop accepting, drain what is queued, flush and close the sink.

        Waits at most ``timeout_s``; returns False when the sink was still
        stalled then (the daemon thread is abandoned, the process can exit).
        """
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- consumer side (sender thread) ----

    def _log_once(self, what: str, exc: BaseException) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(
                "rankscope collector: %s failed (%s: %s); counting further failures silently",
                what,
                type(exc).__name__,
                exc,
            )

    def _take(self) -> tuple[list, bool]:
        with self._cv:
            if len(self._q) < self._wake_at and not self._closing:
                self._cv.wait(self._send_interval_s)
            if not self._q:
                return [], self._closing
            n = min(len(self._q), self._batch_max)
            items = [self._q.popleft() for _ in range(n)]
            self._in_flight = n
            return items, self._closing and not self._q

    def _materialize(self, items: list) -> list[dict]:
        out = []
        for item in items:
            try:
                rec = item() if callable(item) else item
            except Exception as exc:  # a lazy field failed to resolve: lose this record only
                self._log_once("building a record", exc)
                with self._cv:
                    self.stats.dropped_bad_item += 1
                    self._pending_drops += 1
                continue
            out.append(rec)
        return out

    def _stamp(self, batch: list[dict]) -> int:
        with self._cv:
            drops = self._pending_drops
            if not drops:
                return 0
            for rec in batch:
                if rec.get("type") in _STAMPABLE:
                    rec["dropped"] = rec.get("dropped", 0) + drops
                    self._pending_drops = 0
                    return drops
        return 0

    def _send(self, batch: list[dict]) -> bool:
        stamped = self._stamp(batch)
        try:
            self._sink.send(batch)
        except Exception as exc:
            self._log_once("sink send", exc)
            with self._cv:
                self.stats.send_errors += 1
                self.stats.dropped_send_failed += len(batch)
                # the stamped count travelled in the lost batch: carry it on
                self._pending_drops += stamped + len(batch)
            return False
        with self._cv:
            self.stats.sent += len(batch)
        return True

    def _flush(self) -> None:
        try:
            self._sink.flush()
        except Exception as exc:
            self._log_once("sink flush", exc)
            self.stats.flush_errors += 1

    def _run(self) -> None:
        last_flush = time.monotonic()
        unflushed = False
        while True:
            try:
                items, last = self._take()
                if items:
                    batch = self._materialize(items)
                    if batch and self._send(batch):
                        unflushed = True
                    with self._cv:
                        self._in_flight = 0
                now = time.monotonic()
                if unflushed and now - last_flush >= self._flush_interval_s:
                    self._flush()
                    last_flush, unflushed = now, False
                with self._cv:
                    done = self._closing and not self._q
                if last or done:
                    break
            except Exception as exc:  # never let the thread die on a surprise
                self._log_once("sender loop", exc)
                time.sleep(0.01)
        self._flush()
        try:
            self._sink.close()
        except Exception as exc:
            self._log_once("sink close", exc)
        self._closed_sink = True

"""Message decoding as one outcome per message, in the loop or on a second core.

``serve`` spends about a third of its loop turning step arrays into columns
(``decode_message``: a msgspec parse, then whole-column passes), work that
holds the GIL, so a thread would not run beside the engine. ``DecodePool``
hands large batches of message values to worker processes instead; they
come back, in message order, as the ``Outcome`` the loop would have made
itself (``decode_outcome``, the same function on both sides), so verdicts,
dead letters and their reasons do not change. The loop meanwhile feeds the
engine with the outcomes already back.

What crosses between the processes is message bytes one way and our own
decoded columns and records the other (pickled by ``concurrent.futures``;
the bytes from Kafka are never unpickled). While the next outcome is not
back, the loop takes back the batch's last messages no worker has started
(``Future.cancel``) and decodes them itself, so it works instead of waiting
when the workers fall behind. ``serve`` starts the workers when it starts
(``start``; else the first large batch does), and any batch while they start
is decoded in the loop. If the pool breaks (a worker killed), it says so once
at WARNING and the loop decodes everything from then on.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import NamedTuple

from rankscope.pipeline.bus.decode import StepBatch, decode_message

__all__ = ["DecodePool", "Outcome", "decode_outcome", "POOL_MIN_BYTES"]

log = logging.getLogger("rankscope.serve")

POOL_MIN_BYTES = 512 << 10
"""A batch of message values this large goes to the workers (the loop feeds one message
while they decode the next); a smaller one is decoded in the loop, where it costs less
than the hand-over."""


class Outcome(NamedTuple):
    """One message decoded: ``batch`` (step columns) or ``records``, plus ``bad``
    ``(index, reason, record)`` elements; ``error`` is the dead-letter reason of a
    message that is unusable as a whole (then nothing else is set)."""

    batch: StepBatch | None
    records: list
    bad: list
    error: str | None


def decode_outcome(value: bytes | None, min_columns: int) -> Outcome:
    """``decode_message`` of one value, failures included, as an ``Outcome``."""
    good: list = []
    bad: list = []
    try:
        batch = decode_message(value, good, bad, min_columns=min_columns)
    except Exception as exc:  # noqa: BLE001 - any failure is this message's
        why = (str(exc) if isinstance(exc, ValueError)
               else f"decode error: {type(exc).__name__}: {exc}")  # fmt: skip
        return Outcome(None, [], [], why)
    return Outcome(batch, good, bad, None)


def _decode_all(values: list, min_columns: int) -> list[Outcome]:
    return [decode_outcome(v, min_columns) for v in values]


def _ready() -> bool:
    return True


class DecodePool:
    """``workers`` processes decoding batches of message values (see the module)."""

    def __init__(self, workers: int, *, chunk: int = 1) -> None:
        if workers < 1 or chunk < 1:
            raise ValueError(f"decode pool: workers and chunk must be >= 1, got {workers}, {chunk}")
        self.workers = workers
        self.chunk = chunk
        self._pool: ProcessPoolExecutor | None = None
        self._warm: Future | None = None
        self._broken = False

    def outcomes(self, values: list, min_columns: int) -> Iterator[Outcome]:
        """The outcome of each value, in order: from the workers for a large batch once
        they are up, else decoded here, one value at a time as the caller asks."""
        if self._broken or sum(len(v) for v in values if v is not None) < POOL_MIN_BYTES:
            return (decode_outcome(v, min_columns) for v in values)
        if not self._started():
            return (decode_outcome(v, min_columns) for v in values)
        try:
            parts = [self._pool.submit(_decode_all, values[i : i + self.chunk], min_columns)
                     for i in range(0, len(values), self.chunk)]  # fmt: skip
        except Exception as exc:  # a pool that cannot take work: the loop decodes
            self._break(exc)
            return (decode_outcome(v, min_columns) for v in values)
        return self._collect(parts, values, min_columns)

    def _collect(self, parts: list[Future], values: list, min_columns: int):
        here: dict[int, list[Outcome]] = {}  # parts taken back from the workers' queue
        for k, fut in enumerate(parts):
            got = here.pop(k, None)
            if got is None and not self._broken:
                self._steal(parts, k, here, values, min_columns)
                got = here.pop(k, None)
            if got is None and not self._broken:
                try:
                    got = fut.result()
                except Exception as exc:  # a worker died: this part and the rest decode here
                    self._break(exc)
            if got is None:
                got = self._part(values, k, min_columns)
            yield from got

    def _steal(self, parts: list[Future], k: int, here: dict, values: list,
               min_columns: int) -> None:  # fmt: skip
        """While part ``k`` is not back, decode here the last parts no worker has taken
        yet (a cancelled future never runs): the loop works instead of waiting, and
        the outcomes are the same function's either way."""
        j = len(parts) - 1
        while j > k and not parts[k].done():
            if j not in here and parts[j].cancel():
                here[j] = self._part(values, j, min_columns)
            j -= 1

    def _part(self, values: list, k: int, min_columns: int) -> list[Outcome]:
        return _decode_all(values[k * self.chunk : (k + 1) * self.chunk], min_columns)

    def start(self) -> None:
        """Start the workers now, without waiting for them (they take a second or so to
        import); batches decode in the loop until they answer."""
        if self._broken or self._pool is not None:
            return
        try:
            ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx)
            self._warm = self._pool.submit(_ready)
        except Exception as exc:
            self._break(exc)

    def _started(self) -> bool:
        """Start the workers on first use; True once they answer."""
        if self._broken:
            return False
        if self._pool is None:
            self.start()
            return False
        if not self._warm.done():
            return False
        if self._warm.exception() is not None:
            self._break(self._warm.exception())
            return False
        return True

    def _break(self, exc: BaseException) -> None:
        if not self._broken:
            log.warning("decode workers unusable (%s: %s); decoding in the loop from now on",
                        type(exc).__name__, exc)  # fmt: skip
        self._broken = True
        self.close()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

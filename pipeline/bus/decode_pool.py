"""Message decoding as one outcome per message, in the loop or on a second core.

``serve`` spends about a third of its loop turning step arrays into columns
(``decode_message``: a msgspec parse, then whole-column passes), work that
holds the GIL, so a thread would not run beside the engine. ``DecodePool``
hands large batches of message values to worker processes instead; they
come back, in message order, as the ``Outcome`` the loop would have made
itself (``decode_outcome``, the same function on both sides), so verdicts,
dead letters and their reasons do not change. The loop meanwhile feeds the
engine with the outcomes already back.

The hand-over has no thread on the loop's side (a thread there needs the GIL
the engine holds, and ``concurrent.futures`` needed two such hand-offs per
message: the worker sat idle two thirds of the time and the loop decoded half
of every batch itself). The loop copies a batch's values into one shared-memory
segment and sends each worker a small header; workers take parts from the
front of a shared counter (``decode_worker``), and while the next outcome is
not back the loop takes parts from the back and decodes them itself, so it
works instead of waiting. ``serve`` starts the workers when it starts
(``start``); batches decode in the loop until a worker answers. If a worker
dies or sends nothing for ``stall_s``, the pool says so once at WARNING and the
loop decodes everything from then on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Iterator
from multiprocessing import connection, shared_memory
from typing import NamedTuple

from rankscope.pipeline.bus.decode_worker import (
    Outcome,
    claim_back,
    claim_this,
    decode_all,
    decode_outcome,
    widen,
    worker_main,
)

__all__ = ["DecodePool", "Outcome", "decode_outcome", "decode_all", "POOL_MIN_BYTES"]

log = logging.getLogger("rankscope.serve")

POOL_MIN_BYTES = 512 << 10
"""A batch of message values this large goes to the workers (the loop feeds one message
while they decode the next); a smaller one is decoded in the loop, where it costs less
than the hand-over."""

SEGMENT_SPARE = 64 << 20
"""The shared segment grows to twice the largest batch seen, up to this much spare."""


class _Worker(NamedTuple):
    proc: multiprocessing.Process
    tasks: connection.Connection
    results: connection.Connection


class DecodePool:
    """``workers`` processes decoding batches of message values (see the module)."""

    def __init__(self, workers: int, *, chunk: int = 1, stall_s: float = 30.0) -> None:
        if workers < 1 or chunk < 1 or stall_s <= 0:
            raise ValueError(f"decode pool: workers and chunk must be >= 1 and stall_s > 0, "
                             f"got {workers}, {chunk}, {stall_s}")  # fmt: skip
        self.workers = workers
        self.chunk = chunk
        self.stall_s = stall_s
        self._procs: list[_Worker] = []
        self._ready: set[int] = set()
        self._claim = None  # shared [batch, front, back]
        self._shm: shared_memory.SharedMemory | None = None
        self._batch = 0
        self._got: dict[int, list[Outcome]] = {}  # this batch's parts back from the workers
        self._seen: set[int] = set()  # this batch's parts done, here or there
        self._broken = False

    def outcomes(self, values: list, min_columns: int) -> Iterator[Outcome]:
        """The outcome of each value, in order: from the workers for a large batch once
        they are up, else decoded here, one value at a time as the caller asks."""
        if self._broken or sum(len(v) for v in values if v is not None) < POOL_MIN_BYTES:
            return (decode_outcome(v, min_columns) for v in values)
        if not self._started():
            return (decode_outcome(v, min_columns) for v in values)
        try:
            self._settle()
            if not self._broken:
                self._post(values, min_columns)
        except Exception as exc:  # a pool that cannot take work: the loop decodes
            self._break(exc)
        if self._broken:
            return (decode_outcome(v, min_columns) for v in values)
        return self._collect(self._batch, values, min_columns)

    # -- a batch out and back --

    def _post(self, values: list, min_columns: int) -> None:
        """Copy the values into the segment, open the batch's parts, tell the workers."""
        spans, off = [], 0
        for v in values:
            spans.append((-1, 0) if v is None else (off, len(v)))
            off += 0 if v is None else len(v)
        if self._shm is None or self._shm.size < off:
            self._new_segment(off)
        buf = self._shm.buf
        for (at, n), v in zip(spans, values, strict=True):
            if at >= 0:
                buf[at : at + n] = v
        del buf
        self._batch += 1
        self._got, self._seen = {}, set()
        parts = -(-len(values) // self.chunk)
        with self._claim.get_lock():
            self._claim[:] = [self._batch, 0, parts]
        head = (self._batch, self._shm.name, spans, self.chunk, min_columns)
        for w in self._procs:
            w.tasks.send(head)

    def _new_segment(self, size: int) -> None:
        """A segment for ``size`` bytes (room to grow, up to ``SEGMENT_SPARE``), its pages
        reserved now: a full /dev/shm (64 MiB in a default container) then fails here,
        with a reason, where writing into a sparse one would kill the process (SIGBUS)."""
        old, self._shm = self._shm, None
        if old is not None:  # no worker reads it: the last batch is settled
            old.close()
            old.unlink()
        grown = max(size, min(2 * old.size if old is not None else 0, SEGMENT_SPARE), 16 << 20)
        shm = shared_memory.SharedMemory(create=True, size=grown)
        try:
            os.posix_fallocate(shm._fd, 0, grown)
        except OSError as exc:
            shm.close()
            shm.unlink()
            raise OSError(exc.errno, f"cannot reserve {grown >> 20} MiB of shared memory for "
                          f"the decode workers: {exc.strerror}") from exc  # fmt: skip
        self._shm = shm

    def _collect(self, batch: int, values: list, min_columns: int):
        here: dict[int, list[Outcome]] = {}  # parts taken back from the workers' queue
        for k in range(-(-len(values) // self.chunk)):
            got = here.pop(k, None)
            if got is None and batch == self._batch and not self._broken:
                got = self._take(k, here, values, min_columns)
            if got is None:
                got = self._part(values, k, min_columns)
            yield from got

    def _take(self, k: int, here: dict, values: list, min_columns: int):
        """Part ``k``: the workers', else decoded here; while a worker still has it, the
        last parts no one has taken are decoded here (the loop works instead of waiting)."""
        if claim_this(self._claim, self._batch, k):  # no worker has started it
            self._seen.add(k)
            return self._part(values, k, min_columns)
        deadline = time.monotonic() + self.stall_s
        self._pump(0)
        while k not in self._got and not self._broken:
            j = claim_back(self._claim, self._batch, k)
            if j is not None:
                here[j] = self._part(values, j, min_columns)
                self._seen.add(j)
                self._pump(0)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                self._break(TimeoutError(f"no decoded part came back for {self.stall_s:g} s"))
                break
            self._pump(min(left, 1.0))
        return self._got.pop(k, None)

    def _pump(self, timeout: float) -> None:
        """Read whatever the workers sent (waiting up to ``timeout`` for something)."""
        conns = [w.results for w in self._procs]
        try:
            ready = connection.wait(conns + [w.proc.sentinel for w in self._procs], timeout)
            for c in ready:
                if not isinstance(c, connection.Connection):  # a sentinel: a worker ended
                    raise EOFError("a decode worker exited")
                while c.poll():
                    msg = pickle.loads(c.recv_bytes())  # our own worker's decoded columns
                    if msg[0] == "ready":
                        self._ready.add(msg[1])
                    elif msg[0] == self._batch:
                        self._got[msg[1]] = msg[2]
                        self._seen.add(msg[1])
        except (EOFError, OSError) as exc:
            self._break(exc)

    def _settle(self) -> None:
        """Before the segment is rewritten: no more parts of the last batch are taken,
        and those the workers took are back (an abandoned batch leaves some)."""
        if not self._batch:
            return
        with self._claim.get_lock():
            self._claim[2] = self._claim[1]
            taken = self._claim[1]
        deadline = time.monotonic() + self.stall_s
        while len(self._seen & set(range(taken))) < taken and not self._broken:
            left = deadline - time.monotonic()
            if left <= 0:
                self._break(TimeoutError(f"no decoded part came back for {self.stall_s:g} s"))
                return
            self._pump(min(left, 1.0))

    def _part(self, values: list, k: int, min_columns: int) -> list[Outcome]:
        return decode_all(values[k * self.chunk : (k + 1) * self.chunk], min_columns)

    # -- the workers' life --

    def start(self) -> None:
        """Start the workers now, without waiting for them (they take a second or so to
        import); batches decode in the loop until they answer."""
        if self._broken or self._procs:
            return
        try:
            ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
            self._claim = ctx.Array("q", 3)
            for wid in range(self.workers):
                t_recv, t_send = ctx.Pipe(duplex=False)
                r_recv, r_send = ctx.Pipe(duplex=False)
                widen(r_send)
                proc = ctx.Process(target=worker_main, args=(wid, t_recv, r_send, self._claim),
                                   name=f"rankscope-decode-{wid}", daemon=True)  # fmt: skip
                proc.start()
                t_recv.close()
                r_send.close()
                self._procs.append(_Worker(proc, t_send, r_recv))
        except Exception as exc:
            self._break(exc)

    def _started(self) -> bool:
        """Start the workers on first use; True once one of them answers."""
        if self._broken:
            return False
        if not self._procs:
            self.start()
            return False
        if not self._ready:
            self._pump(0)
        return bool(self._ready) and not self._broken

    def _break(self, exc: BaseException) -> None:
        if not self._broken:
            log.warning("decode workers unusable (%s: %s); decoding in the loop from now on",
                        type(exc).__name__, exc)  # fmt: skip
        self._broken = True
        self.close(force=True)

    def close(self, *, force: bool = False) -> None:
        """Tell the workers to exit and let go of them: a healthy worker exits on its own
        (``serve`` does not wait for its interpreter to wind down); ``force`` (a broken or
        stalled pool) terminates them, then kills one that is stopped."""
        procs, self._procs = self._procs, []
        for w in procs:
            try:
                w.tasks.send(None)
            except (OSError, ValueError):  # gone already
                pass
            w.tasks.close()
            w.results.close()  # a worker still sending gets EPIPE and exits
        for w in procs:
            if force and w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=1.0)
                if w.proc.is_alive():  # a stopped process keeps a SIGTERM pending
                    w.proc.kill()
            w.proc.join(timeout=0)  # reaped if it has exited; else when it does
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            shm.unlink()

"""What a decode worker computes (``decode_outcome``) and the process that runs it.

The same ``decode_outcome`` runs in the loop and in the worker, so a message's
outcome does not depend on where it was decoded.

A batch's message values sit in one shared-memory segment that the loop wrote;
the loop sends each worker a small header (batch number, segment name, the
``(offset, length)`` of each value, part size). Workers and the loop take parts
from one shared counter triple ``[batch, front, back]`` under its lock: workers
take from the front, the loop (when it would otherwise wait) from the back, so
every part is decoded exactly once. A worker sends back, for each part it took,
the pickled ``(batch, part, outcomes)``; they are our own decoded columns and
records, and the bytes from Kafka are never unpickled on either side.

No thread in the worker: the result pipe is widened (``widen``) to hold several
results, so the worker runs ahead of a busy loop by that much and then waits.
"""

from __future__ import annotations

import fcntl
import pickle
from typing import NamedTuple

from rankscope.pipeline.bus.decode import StepBatch, decode_message

__all__ = ["Outcome", "decode_outcome", "decode_all", "worker_main", "widen", "claim_front",
           "claim_this", "claim_back", "PIPE_BYTES"]  # fmt: skip

PIPE_BYTES = 1 << 20
"""Pipe buffer asked for (Linux caps it at /proc/sys/fs/pipe-max-size, 1 MiB by default)."""

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


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


def decode_all(values: list, min_columns: int) -> list[Outcome]:
    return [decode_outcome(v, min_columns) for v in values]


def widen(conn) -> None:
    """Ask for a larger buffer on a ``multiprocessing`` pipe end; best effort."""
    try:
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, ValueError):  # not a pipe, or a smaller limit: the default buffer works
        pass


def claim_front(claim, batch: int) -> int | None:
    """The next part of ``batch`` no one has taken, for a worker; None when none is left."""
    with claim.get_lock():
        if claim[0] != batch or claim[1] >= claim[2]:
            return None
        k = claim[1]
        claim[1] = k + 1
        return k


def claim_this(claim, batch: int, k: int) -> bool:
    """Take part ``k`` of ``batch`` for the loop if it is next at the front (no worker has it)."""
    with claim.get_lock():
        if claim[0] != batch or claim[1] != k or k >= claim[2]:
            return False
        claim[1] = k + 1
        return True


def claim_back(claim, batch: int, above: int) -> int | None:
    """The last part of ``batch`` no one has taken, if it is after part ``above``; for the loop."""
    with claim.get_lock():
        if claim[0] != batch or claim[2] - 1 <= above or claim[2] - 1 < claim[1]:
            return None
        claim[2] -= 1
        return claim[2]


def worker_main(wid: int, tasks, results, claim) -> None:
    """Run in the worker process until the loop sends None or goes away."""
    import signal
    from multiprocessing import shared_memory

    # Ctrl-C reaches the whole process group: ``serve`` finishes its batch and closes
    # the pool; a worker that died of it first would read as a broken pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    widen(results)
    results.send_bytes(pickle.dumps(("ready", wid)))
    shm, name = None, None
    try:
        while True:
            try:
                head = tasks.recv()
            except (EOFError, OSError):
                return
            if head is None:
                return
            batch, seg, spans, chunk, min_columns = head
            if seg != name:
                if shm is not None:
                    shm.close()
                shm, name = shared_memory.SharedMemory(name=seg), seg
            buf = shm.buf
            while (k := claim_front(claim, batch)) is not None:
                values = [None if off < 0 else bytes(buf[off : off + n])
                          for off, n in spans[k * chunk : (k + 1) * chunk]]  # fmt: skip
                out = decode_all(values, min_columns)
                results.send_bytes(pickle.dumps((batch, k, out), protocol=pickle.HIGHEST_PROTOCOL))
            del buf
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return
    finally:
        if shm is not None:
            shm.close()

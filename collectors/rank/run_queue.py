"""How long the training thread waited for a CPU: Linux's per-thread ``run_delay``.

On CPU-side timing a step's ``compute_s`` is wall time, so a rank whose
thread sat runnable while other processes held the cores looks slow even
though nothing in it is. ``/proc/thread-self/schedstat`` (second field,
nanoseconds) counts that wait; ``cpu_wait_s`` in the step record is its
growth over the step, so a detector can tell "this rank computes slowly"
from "this host had no core for it" (docs/collectors.md). The file is
opened once, on the thread that first reads it (the training thread), and
re-read with ``pread``: a few microseconds a step, no new file opened.
"""

from __future__ import annotations

import logging
import os

__all__ = ["RunQueueWait"]

log = logging.getLogger("rankscope.collectors")

_PATH = "/proc/thread-self/schedstat"


class RunQueueWait:
    """Seconds the opening thread has waited on a run queue; None where unreadable."""

    __slots__ = ("_fd", "_off", "_path")

    def __init__(self, path: str = _PATH) -> None:
        self._fd: int | None = None
        self._off = False
        self._path = path

    def read(self) -> float | None:
        """The thread's run-queue wait so far, in seconds (never raises)."""
        if self._off:
            return None
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError) as exc:
            self._off = True
            log.warning(
                "rankscope collector: cpu_wait_s not collected (%s: %s: %s); compute_s "
                "stays wall time, so CPU contention on this host can read as slowness",
                self._path,
                type(exc).__name__,
                exc,
            )
            self.close()
            return None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

"""Timing ``Work.wait()``: where an asynchronous collective blocks the rank.

An ``async_op=True`` collective or a ``batch_isend_irecv`` (what pipeline
schedules send activations with) returns at once with ``Work`` objects; the
rank blocks later, in ``work.wait()``. ``dist_wrap`` hands the works it saw
launched on the training thread to ``watch``; the patched ``Work.wait`` adds
the seconds the training thread spends waiting on a watched work to
``comm_s`` and to its collective's ``s`` (and, on CUDA, brackets the wait
with timing events: ``device_timing``). Works nobody watched pass straight
through. Watched works not waited for by the step's end are forgotten then.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.step_state import StepState

__all__ = ["WorkWaitPatch", "timed_wait"]

_MAX_WATCHED = 4096


def timed_wait(state: StepState, timing: Any, entry: dict | None, fault: Any, call: Any) -> Any:
    """Run ``call()``, a wait on the training thread, as time blocked in a collective:
    phase ``collective`` meanwhile, its seconds added to ``comm_s`` and to ``entry``'s
    ``s``, bracketed with device timing events on CUDA. ``fault(exc)`` counts a
    bookkeeping failure; the wait's own result or exception is what the caller gets."""
    mark = timing.blocked_begin() if timing is not None else None
    prev, state.phase = state.phase, "collective"
    t0 = time.perf_counter()
    try:
        return call()
    finally:
        dt = time.perf_counter() - t0
        state.phase = prev
        try:
            state.comm_s += dt
            if entry is not None:
                state.finish_collective(entry, entry.get("s", 0.0) + dt)
            if mark is not None:
                timing.blocked_end(mark)
        except Exception as exc:
            fault(exc)


class WorkWaitPatch:
    """Installs and removes the ``Work.wait`` wrapper for one collector."""

    def __init__(
        self, state: StepState, training_thread: int, faults: Faults, timing: Any = None
    ) -> None:
        self._state, self._thread, self._faults, self._timing = (
            state, training_thread, faults, timing
        )  # fmt: skip
        self._watched: dict[int, tuple[Any, dict]] = {}  # id(work) -> (work, entry)
        self._cls: Any = None
        self._orig: Any = None
        self._wrapper: Any = None

    def watch(self, result: Any, entry: dict) -> None:
        """Watch the work(s) an asynchronous collective returned (training thread)."""
        works = result if isinstance(result, (list, tuple)) else (result,)
        for w in works:
            if hasattr(w, "wait") and len(self._watched) < _MAX_WATCHED:
                self._watched[id(w)] = (w, entry)  # holding w keeps its id unique

    def step_done(self) -> None:
        self._watched.clear()

    def install(self) -> None:
        try:
            from torch._C._distributed_c10d import Work
        except Exception:
            return
        self._cls, self._orig = Work, Work.wait
        self._wrapper = self._wrap(Work.wait)
        Work.wait = self._wrapper

    def uninstall(self) -> None:
        if self._cls is not None and self._cls.wait is self._wrapper:
            self._cls.wait = self._orig
        self._cls = None
        self._watched.clear()

    def _wrap(self, orig: Any) -> Any:
        state, watched = self._state, self._watched

        @functools.wraps(orig)
        def wait(work, *args, **kwargs):
            if not watched or threading.get_ident() != self._thread:
                return orig(work, *args, **kwargs)
            item = watched.pop(id(work), None)
            if item is None or item[0] is not work:
                return orig(work, *args, **kwargs)
            return timed_wait(state, self._timing, item[1], self._fault,
                              lambda: orig(work, *args, **kwargs))  # fmt: skip

        wait.__rankscope_wrapped__ = True
        return wait

    def _fault(self, exc: Exception) -> None:
        self._faults.hit("collective bookkeeping (Work.wait)", exc)

"""The beat thread: a progress heartbeat once per interval, also while blocked.

A hang shows up as ranks that stop finishing steps, which by itself does not
say which rank is to blame. Beats do: a rank stuck in ``forward`` whose last
collective is done, while its peers sit in ``collective`` on the next
sequence number, is the one the others wait for. The thread only reads the
live ``StepState`` and enqueues a small record, so it keeps beating while the
training thread is blocked in C++ (gloo/NCCL waits release the GIL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rankscope.collectors.rank.step_state import StepState
from rankscope.collectors.schema.records import BeatRecord

__all__ = ["BeatThread"]

log = logging.getLogger("rankscope.collectors")


class BeatThread:
    """Emits ``beat`` records every ``interval_s`` until stopped."""

    def __init__(
        self,
        *,
        state: StepState,
        job: str,
        rank: int,
        host: str,
        interval_s: float,
        emit: Callable[[dict], None],
    ) -> None:
        self._state = state
        self._job, self._rank, self._host = job, rank, host
        self._interval_s = interval_s
        self._emit = emit
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="rankscope-beat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def collect(self) -> dict:
        """One beat record describing this instant."""
        st = self._state
        last = st.last_coll
        rec = BeatRecord(
            job=self._job,
            rank=self._rank,
            host=self._host,
            t=time.time(),
            step=st.step,
            phase=st.phase,
        )
        if last is not None:
            rec.coll_group, rec.coll_seq, rec.coll_op = last.group, last.seq, last.op
            rec.coll_done = last.done
        return rec.to_dict()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._emit(self.collect())
                self.beats += 1
            except Exception as exc:  # keep beating
                log.debug("beat failed: %s", exc)

    def stop(self, *, final_beat: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._interval_s + 1.0)
        if final_beat:
            try:
                self._emit(self.collect())
            except Exception as exc:
                log.debug("final beat failed: %s", exc)

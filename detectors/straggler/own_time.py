"""A rank's own compute: ``compute_s`` less the wait for a CPU beyond its usual.

Timed on the CPU, ``compute_s`` is wall time: a rank whose thread waited for
a core while other threads held them (an oversubscribed host) reads slow for
as long as the scheduler favours the others, though nothing in the rank is.
Where the writer reports ``cpu_wait_s`` (the thread's run-queue wait over
the step), a share ``q = cpu_wait_s / step_s`` of ``compute_s`` is taken as
waiting; the detector judges compute as it would have been at the rank's
usual share (``UsualWait``, learnt over ~100 steps): ``compute_s x (1 - q) /
(1 - usual)``, the wait's every step-to-step swing taken out. A spell of waiting
is the host's chance; a wait that lasts becomes the rank's usual, so a rank
its host starves for good reads slow again (a noisy neighbour is named).
Only when every rank that reports ``compute_s`` reports the wait too: a group
mixing both would blame the ranks without it. The network detector keeps
wall times. A signal judged so carries the wall ``compute_s``,
``cpu_wait_s`` and the usual share in its evidence. Notes: docs/detectors.md.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from rankscope.detectors.evidence import num
from rankscope.detectors.frame import StepFrame

__all__ = ["UsualWait", "own_time", "net_of_host_wait"]

USUAL_WAIT_STEPS = 100  # a share of waiting that lasts this long is the rank's usual
WARM_STEPS = 20  # a plain mean over a rank's first steps, then exponential
MAX_SHARE = 0.9  # of a step; more is not a measurement to scale by


def _share(frame: StepFrame) -> np.ndarray | None:
    """Per row, the share of its step spent waiting for a CPU; None when the step
    cannot be judged net (some rank reporting compute reports no wait)."""
    wait, comp = frame.m.get("cpu_wait_s"), frame.m.get("compute_s")
    if wait is None or comp is None:
        return None
    has = np.isfinite(comp)
    if not has.any() or not np.isfinite(wait[has]).all():
        return None
    step = frame.m.get("step_s", np.full(frame.n, np.nan))
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = np.isfinite(step) & (step > 0) & np.isfinite(wait)
        return np.where(ok, np.clip(wait / np.where(ok, step, 1.0), 0.0, MAX_SHARE), np.nan)


class UsualWait:
    """Per rank, the share of its step it usually waits for a CPU: the mean of its
    first ``WARM_STEPS``, then an exponential mean over ``steps`` (arrays by rank)."""

    def __init__(self, steps: int = USUAL_WAIT_STEPS) -> None:
        self.steps = steps
        self.share = np.full(0, np.nan)
        self.seen = np.zeros(0, dtype=np.int64)

    def usual(self, ranks) -> np.ndarray:
        ranks = np.asarray(ranks, dtype=np.int64)
        out = np.full(ranks.shape, np.nan)
        known = ranks < self.share.size
        out[known] = self.share[ranks[known]]
        return out

    def learn(self, frame: StepFrame) -> None:
        q = _share(frame)
        if q is None:
            return
        ok = np.isfinite(q)
        ranks, v = frame.rank[ok], q[ok]
        if not ranks.size:
            return
        if ranks.max() >= self.share.size:
            grow = int(ranks.max()) + 1 - self.share.size
            self.share = np.concatenate([self.share, np.full(grow, np.nan)])
            self.seen = np.concatenate([self.seen, np.zeros(grow, dtype=np.int64)])
        n = self.seen[ranks] + 1
        self.seen[ranks] = np.minimum(n, WARM_STEPS)
        old = np.where(np.isnan(self.share[ranks]), v, self.share[ranks])
        self.share[ranks] = old + (v - old) / np.where(n <= WARM_STEPS, n, self.steps)

    def state_dict(self) -> dict:
        known = np.flatnonzero(self.seen > 0)
        return {"ranks": known.tolist(), "share": self.share[known].tolist(),
                "seen": self.seen[known].tolist()}  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        ranks = np.asarray(d.get("ranks", []), dtype=np.int64)
        size = int(ranks.max()) + 1 if ranks.size else 0
        self.share, self.seen = np.full(size, np.nan), np.zeros(size, dtype=np.int64)
        self.share[ranks] = np.asarray(d.get("share", []), dtype=np.float64)
        self.seen[ranks] = np.asarray(d.get("seen", []), dtype=np.int64)


def own_time(frame: StepFrame, usual: UsualWait) -> StepFrame:
    """``frame`` with ``compute_s`` at each rank's usual wait where it can be told
    (once per frame: the detector and its learning see the same one)."""
    return frame.memo("own_time", lambda f: _net(f, usual))


def _net(frame: StepFrame, usual: UsualWait) -> StepFrame:
    q = _share(frame)
    if q is None:
        return frame
    base = usual.usual(frame.rank)
    comp = frame.m["compute_s"]
    ok = np.isfinite(comp) & np.isfinite(base) & np.isfinite(q)
    net = np.where(ok, comp * (1.0 - np.where(ok, q, 0.0)) / (1.0 - np.where(ok, base, 0.0)), comp)
    return dataclasses.replace(frame, m={**frame.m, "compute_s": net})


def net_of_host_wait(detect):
    """Wrap a straggler ``detect(frame, state, cfg)`` to judge ``own_time(frame)``
    (``state.usual_wait`` the ``UsualWait``)."""

    @functools.wraps(detect)
    def judged_net(frame: StepFrame, state, cfg):
        own = own_time(frame, state.usual_wait)
        out = detect(own, state, cfg)
        if own is not frame:
            base = state.usual_wait.usual(frame.rank)
            for sig in out.signals:
                row = np.flatnonzero(frame.rank == sig.ranks[0])[:1]
                if row.size:
                    i = int(row[0])
                    sig.evidence["compute_wall_s"] = num(frame.m["compute_s"][i])
                    sig.evidence["cpu_wait_s"] = num(frame.m["cpu_wait_s"][i])
                    sig.evidence["usual_wait_share"] = num(base[i])
        return out

    return judged_net

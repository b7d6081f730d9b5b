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
``cpu_wait_s`` and the usual share in its evidence; one named only after its
wait became its usual is dated from the step the wait rose (``UsualWait.rise``).
Notes: docs/detectors.md.
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
RISE_SHARE = 0.1  # of a step: a wait this far over the usual is a rise
RISE_FIRM = 3  # steps a rise holds before a miss is forgiven
RISE_STEPS = 10  # steps a rise holds before it dates a finding


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
        self._empty(0)

    def _empty(self, n: int) -> None:
        self.share = np.full(n, np.nan)
        self.seen = np.zeros(n, dtype=np.int64)
        self.run = np.zeros((n, 3), dtype=np.int64)  # _rise: seen, misses, last missed
        self.since = np.full(n, -1, dtype=np.int64)  # the step the present rise began
        self.rise_base = np.full(n, np.nan)  # the usual share at that step

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
            self.run = np.concatenate([self.run, np.zeros((grow, 3), dtype=np.int64)])
            self.since = np.concatenate([self.since, np.full(grow, -1, dtype=np.int64)])
            self.rise_base = np.concatenate([self.rise_base, np.full(grow, np.nan)])
        self._rise(ranks, v, int(frame.step))
        n = self.seen[ranks] + 1
        self.seen[ranks] = np.minimum(n, WARM_STEPS)
        old = np.where(np.isnan(self.share[ranks]), v, self.share[ranks])
        self.share[ranks] = old + (v - old) / np.where(n <= WARM_STEPS, n, self.steps)

    def _rise(self, ranks: np.ndarray, v: np.ndarray, step: int) -> None:
        """Per warm rank, the run of steps its share has held ``RISE_SHARE`` over the
        usual share at the run's first step. A short miss is forgiven once the run
        is ``RISE_FIRM`` steps long (misses at most a third); two in a row, or one
        before then, end it: a lone spike of waiting starts nothing that lasts."""
        warm = self.seen[ranks] >= WARM_STEPS
        r, q = ranks[warm], v[warm]
        run = self.since[r] >= 0
        starts = r[~run][q[~run] - self.share[r[~run]] >= RISE_SHARE]
        self.since[starts], self.rise_base[starts] = step, self.share[starts]
        self.run[starts] = (1, 0, 0)
        r, q = r[run], q[run]
        seen, misses, last = self.run[r].T
        held = q - self.rise_base[r] >= RISE_SHARE
        ends = ~held & ((last > 0) | (seen < RISE_FIRM) | (3 * (misses + 1) > seen + 1))
        self.since[r[ends]] = -1
        self.run[r[~ends]] = np.stack([seen + 1, misses + ~held, ~held], axis=1)[~ends]

    def rise(self, rank: int) -> tuple[int, float] | None:
        """(step, usual share then) of the rank's wait for a CPU that rose at that step
        and has held for ``RISE_STEPS``; None when its wait is at its usual."""
        if rank >= self.since.size or self.since[rank] < 0:
            return None
        if self.run[rank][0] < RISE_STEPS:
            return None
        return int(self.since[rank]), float(self.rise_base[rank])

    def state_dict(self) -> dict:
        known = np.flatnonzero(self.seen > 0)
        return {"ranks": known.tolist(), "share": self.share[known].tolist(),
                "seen": self.seen[known].tolist(), "run": self.run[known].tolist(),
                "since": self.since[known].tolist(),
                "rise_base": [None if np.isnan(b) else float(b)
                              for b in self.rise_base[known]]}  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        ranks = np.asarray(d.get("ranks", []), dtype=np.int64)
        size = int(ranks.max()) + 1 if ranks.size else 0
        self._empty(size)
        self.share[ranks] = np.asarray(d.get("share", []), dtype=np.float64)
        self.seen[ranks] = np.asarray(d.get("seen", []), dtype=np.int64)
        if "since" in d:  # saved before the rise was kept: none known
            self.run[ranks] = np.asarray(d["run"], dtype=np.int64).reshape(-1, 3)
            self.since[ranks] = np.asarray(d["since"], dtype=np.int64)
            base = [np.nan if b is None else b for b in d["rise_base"]]
            self.rise_base[ranks] = np.asarray(base, dtype=np.float64)


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
                    _since_the_wait_rose(sig.evidence, frame, i, state.usual_wait)
        return out

    return judged_net


def _since_the_wait_rose(ev: dict, frame: StepFrame, i: int, usual: UsualWait) -> None:
    """A rank named once its lasting wait became its usual (a noisy neighbour) was slow
    since the wait rose, though the judged gap shows only from later: the onset is
    moved back to that step where the wait explains at least half the slowdown on
    the wall clock (its compute over its partner's or peers')."""
    rise = usual.rise(int(frame.rank[i]))
    onset = ev.get("onset_step")
    if rise is None or not isinstance(onset, int) or rise[0] >= onset:
        return
    if ev.get("metric") != "compute_s":
        return
    q = _share(frame)
    peer = ev.get("peer_median")
    wall = frame.m["compute_s"][i]
    if q is None or not np.isfinite(q[i]) or not isinstance(peer, float) or peer <= 0:
        return
    slow = np.log(wall / peer)
    waited = np.log((1.0 - rise[1]) / (1.0 - q[i]))
    if slow > 0 and waited >= 0.5 * slow:
        ev["onset_step"] = rise[0]
        ev["wait_rose_step"] = rise[0]

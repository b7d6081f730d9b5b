"""Streak counters per rank: a deviation must last before it is a finding.

One slow step is noise (a long sequence, a page fault); the same rank slow
step after step is a straggler. ``StreakCounter`` keeps, per global rank, how
many consecutive steps it has deviated. Ranks absent from a step keep their
count (absence is judged elsewhere), so a late record does not reset it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["StreakCounter", "FlagRate", "RANK_LIMIT", "usable_ranks", "required_streak"]

# Per-rank state is indexed by global rank. A garbage rank id (negative, or
# 2**40 from a broken foreign writer) must not allocate gigabytes or alias
# another rank: ids outside [0, RANK_LIMIT) get no per-rank state.
RANK_LIMIT = 1 << 22


def usable_ranks(ranks: np.ndarray) -> np.ndarray:
    """Mask of rank ids that may index per-rank state."""
    return (ranks >= 0) & (ranks < RANK_LIMIT)


class StreakCounter:
    """Per-rank count of consecutive deviating steps."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = np.zeros(0, dtype=np.int64)

    def peek(self, ranks: np.ndarray) -> np.ndarray:
        """Current streaks of ``ranks`` (0 for ranks never seen)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and int(ranks.max()) < self.count.shape[0] and int(ranks.min()) >= 0:
            return self.count[ranks]
        out = np.zeros(ranks.shape[0], dtype=np.int64)
        known = usable_ranks(ranks) & (ranks < self.count.shape[0])
        out[known] = self.count[ranks[known]]
        return out

    def update(self, ranks: np.ndarray, hit: np.ndarray, leaky: bool = False) -> np.ndarray:
        """Advance the streak of ranks hit this step, reset the others; return the streaks.

        ``leaky``: a miss takes one step off the streak instead of resetting it,
        so evidence that holds most steps (a straggler in a noisy job, seen
        two steps out of three) still adds up.
        """
        ranks = np.asarray(ranks, dtype=np.int64)
        hit = np.asarray(hit, dtype=bool)
        if ranks.size == 0:
            return np.zeros(0, dtype=np.int64)
        ok = usable_ranks(ranks)
        if not ok.all():  # garbage ids: a streak of this step only
            streak = hit.astype(np.int64)
            streak[ok] = self.update(ranks[ok], hit[ok], leaky)
            return streak
        top = int(ranks.max()) + 1
        if self.count.shape[0] < top:
            grown = np.zeros(max(top, 2 * self.count.shape[0]), dtype=np.int64)
            grown[: self.count.shape[0]] = self.count
            self.count = grown
        before = self.count[ranks]
        streak = np.where(hit, before + 1, np.maximum(before - 1, 0) if leaky else 0)
        self.count[ranks] = streak
        return streak

    def state_dict(self) -> dict:
        nz = np.flatnonzero(self.count)
        return {"ranks": nz.tolist(), "count": self.count[nz].tolist()}

    def load_state_dict(self, d: dict) -> None:
        ranks = np.asarray(d.get("ranks", []), dtype=np.int64)
        self.count = np.zeros(int(ranks.max()) + 1 if ranks.size else 0, dtype=np.int64)
        self.count[ranks] = np.asarray(d.get("count", []), dtype=np.int64)


class FlagRate:
    """How often a rank starts a deviation by chance, to size the persistence needed.

    A fixed "two steps in a row" is right for a quiet job and wrong for a noisy
    one: where isolated deviations start at rate p per rank and step, a streak
    of k happens by chance about p**k of the time, so ``required`` asks for
    the k that keeps chance streaks across ``rows`` ranks under ``target``
    per step (never fewer than ``base``, never more than ``cap``). The rate is
    a running mean over about ``window`` steps of streaks that ENDED before
    they were confirmed: deviations that chance produced, so a real fault,
    which is confirmed, never makes its own confirmation slower.
    """

    __slots__ = ("rate", "steps", "window")

    def __init__(self, window: int = 32) -> None:
        self.rate = 0.0
        self.steps = 0
        self.window = max(int(window), 1)

    def observe(self, starts: int, rows: int) -> None:
        if rows <= 0:
            return
        self.steps += 1
        self.rate += (starts / rows - self.rate) / min(self.steps, self.window)

    def required(self, base: int, cap: int, rows: int, target: float) -> int:
        p = self.rate
        if p <= 0.0:
            return base
        if p >= 1.0:
            return cap
        k = math.ceil(math.log(target / max(rows, 1)) / math.log(p) - 1e-9)
        return int(min(max(k, base), cap))

    def state_dict(self) -> dict:
        return {"rate": self.rate, "steps": self.steps}

    def load_state_dict(self, d: dict) -> None:
        self.rate = float(d.get("rate", 0.0))
        self.steps = int(d.get("steps", 0))


def required_streak(rate: FlagRate, prev, hit, rows: int, cfg, *, prior: bool = False,
                    leaky: bool = True) -> int:  # fmt: skip
    """The one streak rule of straggler and network: the streak needed now (from the
    job's chance rate so far, ``cfg`` a ConsensusConfig); then count the streaks chance ended.

    ``leaky`` streaks (a miss takes one off) end when they fall from 1 to 0; plain
    ones end at any miss short of ``need``. With ``prior``, a chance rate not seen yet
    is not taken for zero: it is at least one end in all the rank-steps seen so far
    (early in a small job, before its noise is known, a streak must be longer).
    """
    args = (cfg.persist_steps, cfg.max_persist_steps, int(rows), cfg.chance_findings_per_step)
    need = rate.required(*args)
    if prior and rate.steps > 0:
        unseen = FlagRate()
        unseen.rate = 1.0 / (max(int(rows), 1) * rate.steps)
        need = max(need, unseen.required(*args))
    if rate.steps < cfg.history_min_steps:  # the first steps of a job (warm-up) teach only
        need = cfg.max_persist_steps + 1_000_000
    ended = (prev == 1) if leaky else (prev > 0) & (prev < need)
    rate.observe(int(np.count_nonzero(~hit & ended)), int(rows))
    return need

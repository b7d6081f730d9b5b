"""How long a straggler's slow streak must be: per metric, per level, from the chance rate.

Design notes: docs/detectors.md, "detectors/straggler/streaks.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.persistence import FlagRate, StreakCounter

__all__ = ["SlowStreaks", "required_streak"]

LEVELS = ("slow", "strong")


class SlowStreaks:
    """Streak counters and chance rates per (metric, level)."""

    __slots__ = ("metrics", "streak", "rate")

    def __init__(self, metrics: tuple[str, ...], window: int) -> None:
        self.metrics = tuple(metrics)
        keys = [(m, lvl) for m in self.metrics for lvl in LEVELS]
        self.streak = {k: StreakCounter() for k in keys}
        self.rate = {k: FlagRate(window) for k in keys}

    def open(self) -> bool:
        """Whether any rank has a streak going (else a step without hits changes nothing)."""
        return any(s.count.any() for s in self.streak.values())

    def idle(self, rows: int) -> None:
        """A step in which nobody was slow and no streak was open."""
        for r in self.rate.values():
            r.observe(0, rows)

    def update(self, ranks, hit, strong, cfg) -> tuple[np.ndarray, np.ndarray]:
        """Advance with this step's ``hit`` and ``strong`` (metrics x rows) flags.

        Returns per row (confirmed, longest confirmed streak). ``cfg`` gives
        ``persist_steps``, ``max_persist_steps``, ``chance_findings_per_step``
        and ``history_min_steps`` (warm-up steps that only teach).
        """
        n = ranks.shape[0]
        confirmed = np.zeros(n, dtype=bool)
        longest = np.zeros(n, dtype=np.int64)
        for i, m in enumerate(self.metrics):
            for lvl, flags in (("slow", hit[i]), ("strong", strong[i])):
                counter, rate = self.streak[(m, lvl)], self.rate[(m, lvl)]
                if not (flags.any() or counter.count.any()):
                    rate.observe(0, n)
                    continue
                prev = counter.peek(ranks)
                streak = counter.update(ranks, flags, leaky=True)
                if streak.max() > cfg.max_persist_steps:
                    # more is not more evidence, and a long fault's streak must not
                    # outlive it (leaking one a step) by as many steps as it lasted
                    np.minimum(counter.count, cfg.max_persist_steps, out=counter.count)
                    streak = np.minimum(streak, cfg.max_persist_steps)
                ok = flags & (streak >= required_streak(rate, prev, flags, n, cfg, prior=True))
                confirmed |= ok
                longest = np.where(ok, np.maximum(longest, streak), longest)
        return confirmed, longest

    def state_dict(self) -> dict:
        return {
            f"{m}/{lvl}": {
                "streak": self.streak[(m, lvl)].state_dict(),
                "rate": self.rate[(m, lvl)].state_dict(),
            }
            for (m, lvl) in self.streak
        }

    def load_state_dict(self, d: dict) -> None:
        for (m, lvl), counter in self.streak.items():
            sub = d.get(f"{m}/{lvl}", {})
            counter.load_state_dict(sub.get("streak", {}))
            self.rate[(m, lvl)].load_state_dict(sub.get("rate", {}))


def required_streak(rate: FlagRate, prev, hit, rows: int, cfg, prior: bool = False) -> int:
    """Streak needed now (from the chance rate so far); then count streaks chance ended.

    Streaks leak (a miss takes one off), so one ends when it falls from 1 to 0.
    With ``prior``, a chance rate not seen yet is not taken for zero: the rate
    is at least one chance end in all the rank-steps seen so far (so early in a
    small job, before its noise is known, a streak must be longer).
    """
    args = (cfg.persist_steps, cfg.max_persist_steps, int(rows), cfg.chance_findings_per_step)
    need = rate.required(*args)
    if prior and rate.steps > 0:  # the rate is at least one end in the rank-steps seen
        unseen = FlagRate()
        unseen.rate = 1.0 / (max(int(rows), 1) * rate.steps)
        need = max(need, unseen.required(*args))
    if rate.steps < cfg.history_min_steps:  # the first steps of a job (warm-up) teach only
        need = cfg.max_persist_steps + 1_000_000
    rate.observe(int(np.count_nonzero(~hit & (prev == 1))), int(rows))
    return need

"""How long a straggler's slow streak must be: per metric, per level, from the chance rate.

Design notes: docs/detectors.md, "detectors/straggler/streaks.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.persistence import FlagRate, StreakCounter, required_streak

__all__ = ["SlowStreaks"]

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

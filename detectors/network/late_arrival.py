"""Persistent last arrival: the rank that is late to its collectives step after step.

Design notes: docs/detectors.md, "detectors/network/late_arrival.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from rankscope.detectors.stats.persistence import usable_ranks

__all__ = ["LastArrivalScan", "min_count"]


@lru_cache(maxsize=4096)
def min_count(steps: int, members: int, alpha: float) -> int:
    """Smallest c with P(Binomial(steps, 1/members) >= c) <= alpha (steps + 1: never)."""
    p = 1.0 / max(members, 1)
    tail = 0.0
    for c in range(steps, -1, -1):
        tail += math.comb(steps, c) * p**c * (1 - p) ** (steps - c)
        if tail > alpha:
            return c + 1
    return 0


class LastArrivalScan:
    """Per rank, the last ``window`` observed steps: was it last, and its work ratio."""

    __slots__ = ("window", "last", "work", "filled", "pos")

    def __init__(self, window: int = 20) -> None:
        self.window = int(window)
        self.last = np.zeros((0, self.window), dtype=bool)
        self.work = np.full((0, self.window), np.nan)
        self.filled = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)

    def _grow(self, top: int) -> None:
        have = self.pos.shape[0]
        if top <= have:
            return
        new = max(top, 2 * have)
        self.last = np.concatenate([self.last, np.zeros((new - have, self.window), bool)])
        self.work = np.concatenate([self.work, np.full((new - have, self.window), np.nan)])
        self.filled = np.concatenate([self.filled, np.zeros(new - have, np.int64)])
        self.pos = np.concatenate([self.pos, np.zeros(new - have, np.int64)])

    def update(
        self, ranks: np.ndarray, last: np.ndarray, work: np.ndarray, seen: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Record this step for ``seen`` rows; per row: (times last, steps observed, work ratio).

        ``work`` is the row's own work time over its peers' median; its median
        over the steps where the row arrived last says whether its own work
        explains the lateness (a straggler) or not (its communication).
        """
        ranks = np.asarray(ranks, dtype=np.int64)
        ok = usable_ranks(ranks)
        n = ranks.shape[0]
        out_last = np.zeros(n, dtype=np.int64)
        out_seen = np.zeros(n, dtype=np.int64)
        out_work = np.full(n, np.nan)
        if not ok.any():
            return out_last, out_seen, out_work
        self._grow(int(ranks[ok].max()) + 1)
        rec = ok & seen
        r = ranks[rec]
        slot = self.pos[r]
        self.last[r, slot] = last[rec]
        self.work[r, slot] = work[rec]
        self.pos[r] = (slot + 1) % self.window
        self.filled[r] = np.minimum(self.filled[r] + 1, self.window)
        out_last[ok] = self.last[ranks[ok]].sum(axis=1)
        out_seen[ok] = self.filled[ranks[ok]]
        with np.errstate(invalid="ignore"):  # its own work on the steps it arrived last
            sub = np.where(self.last[ranks[ok]], self.work[ranks[ok]], np.nan)
            have = np.isfinite(sub).any(axis=1)
            med = np.full(sub.shape[0], np.nan)
            if have.any():
                med[have] = np.nanmedian(sub[have], axis=1)
        out_work[ok] = med
        return out_last, out_seen, out_work

    def state_dict(self) -> dict:
        work = self.work.astype(object)
        work[np.isnan(self.work)] = None
        return {
            "window": self.window,
            "last": self.last.astype(np.int8).tolist(),
            "work": work.tolist(),
            "filled": self.filled.tolist(),
            "pos": self.pos.tolist(),
        }

    def load_state_dict(self, d: dict) -> None:
        if int(d.get("window", self.window)) != self.window:
            raise ValueError(f"scan state has window {d.get('window')}, not {self.window}")
        self.pos = np.asarray(d.get("pos", []), dtype=np.int64)
        r = self.pos.shape[0]
        self.filled = np.asarray(d.get("filled", []), dtype=np.int64)
        self.last = np.asarray(d.get("last", []), dtype=bool).reshape(r, self.window)
        work = np.array(d.get("work", []), dtype=object).reshape(r, self.window)
        work[work == None] = np.nan  # noqa: E711 (elementwise on an object array)
        self.work = work.astype(np.float64)

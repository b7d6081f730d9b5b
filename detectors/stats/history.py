"""Per-rank rolling baseline: each rank compared with its own recent past.

Design notes: docs/detectors.md, "detectors/stats/history.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.persistence import RANK_LIMIT, usable_ranks
from rankscope.detectors.stats.robust import MAD_TO_SIGMA, quantile_sorted

__all__ = ["RankHistory"]

_TABLE_MIN_RANKS = 64
"""Calls for at least this many ranks use the per-metric table of every rank's statistics."""


class RankHistory:
    """Last ``window`` clean readings per rank for each of ``metrics``."""

    __slots__ = ("metrics", "window", "buf", "pos", "_mi", "_table")

    def __init__(self, metrics: tuple[str, ...], window: int = 32) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.metrics = tuple(metrics)
        self.window = int(window)
        self._mi = {m: i for i, m in enumerate(self.metrics)}
        self.buf = np.full((len(self.metrics), 0, self.window), np.nan)
        self.pos = np.zeros(0, dtype=np.int64)
        self._table: dict[str, list] = {}  # metric -> [count, median, windows, sigma or None]

    def _grow(self, n_ranks: int) -> None:
        have = self.pos.shape[0]
        if n_ranks <= have:
            return
        new = max(n_ranks, 2 * have)
        pad = np.full((len(self.metrics), new - have, self.window), np.nan)
        self.buf = np.concatenate([self.buf, pad], axis=1)
        self.pos = np.concatenate([self.pos, np.zeros(new - have, dtype=np.int64)])

    def learn(self, ranks: np.ndarray, values: dict[str, np.ndarray], clean: np.ndarray) -> None:
        """Append the readings of clean rows; NaN readings are stored as gaps."""
        ranks = np.asarray(ranks, dtype=np.int64)
        clean = np.asarray(clean, dtype=bool)
        self._table.clear()
        if ranks.size == 0:
            return
        if int(ranks.min()) < 0 or int(ranks.max()) >= RANK_LIMIT:
            clean = clean & usable_ranks(ranks)
        every = bool(clean.all())
        if not every:
            ranks = ranks[clean]
        if ranks.size == 0:
            return
        self._grow(int(ranks.max()) + 1)
        slot = self.pos[ranks]
        flat = ranks * self.window + slot  # one flat put per metric
        for m, i in self._mi.items():
            v = values.get(m)
            if v is None:
                v = np.full(ranks.shape[0], np.nan)
            else:
                v = np.asarray(v, dtype=np.float64)
                v = v if every else v[clean]
            np.put(self.buf[i], flat, v)
        slot += 1
        slot[slot == self.window] = 0
        self.pos[ranks] = slot

    def assess(self, ranks: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(count, median, robust sigma) of each rank's window; no state change.

        Ranks never seen get count 0 and NaN statistics. A call for many ranks
        computes every known rank's statistics once until the next ``learn`` (a
        step asks for the same metric over all ranks more than once; each row's
        statistics depend on that row alone, so the answer is the same)."""
        return self._lookup(ranks, metric, sigma=True)

    def median(self, ranks: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(count, median) of each rank's window: ``assess`` less the sigma, which
        costs a second sort of every window and most callers do not use."""
        return self._lookup(ranks, metric, sigma=False)[:2]

    def _lookup(self, ranks, metric: str, *, sigma: bool):
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.shape[0] < _TABLE_MIN_RANKS:
            return self._stats(ranks, metric, sigma=sigma)
        table = self._table.get(metric)
        if table is None:
            table = self._table[metric] = [*self._centre(np.arange(self.pos.shape[0]), metric),
                                           None]  # fmt: skip
        if sigma and table[3] is None:
            table[3] = _sigma(table[2], table[0], table[1])
        stats = (table[0], table[1], table[3] if sigma else table[1])  # no sigma: unread
        known = usable_ranks(ranks) & (ranks < self.pos.shape[0])
        if known.all():
            return tuple(a[ranks] for a in stats)
        at = np.where(known, ranks, 0)
        if not self.pos.shape[0]:  # nothing learnt yet: nothing to look up
            z = np.zeros(ranks.shape[0], dtype=np.int64)
            return z, np.full(z.shape[0], np.nan), np.full(z.shape[0], np.nan)
        count = np.where(known, stats[0][at], 0)
        return count, np.where(known, stats[1][at], np.nan), np.where(known, stats[2][at], np.nan)

    def _stats(self, ranks: np.ndarray, metric: str, *, sigma: bool = True):
        """(count, median, sigma or None) of ``ranks`` alone, without the table."""
        count, med, sub = self._centre(ranks, metric)
        return count, med, _sigma(sub, count, med) if sigma else None

    def _centre(self, ranks: np.ndarray, metric: str):
        """(count, median, the windows with NaN gaps) of ``ranks``."""
        k = ranks.shape[0]
        known = usable_ranks(ranks) & (ranks < self.pos.shape[0])
        buf = self.buf[self._mi[metric]]
        if known.all():  # the usual call (every rank of the step): one gather, no mask
            sub = buf[:k] if _is_range(ranks) else buf[ranks]
        else:
            sub = np.full((k, self.window), np.nan)
            sub[known] = buf[ranks[known]]
        finite = np.isfinite(sub)
        if not finite.all():  # gaps (NaN) and infinities both count as no reading
            sub = np.where(finite, sub, np.nan)
        count = finite.sum(axis=1)
        s = np.sort(sub, axis=1)
        with np.errstate(invalid="ignore"):
            med = quantile_sorted(s, count, 0.5)
        return count, med, sub

    def slow_limit(
        self,
        ranks: np.ndarray,
        metric: str,
        *,
        ratio: float,
        k_sigma: float,
        min_count: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per rank: (limit above which it is slow for itself, history median).

        limit = max(ratio x median, median + k_sigma x sigma); NaN until the
        rank has ``min_count`` clean readings.
        """
        count, med, sigma = self.assess(ranks, metric)
        limit = np.maximum(ratio * med, med + k_sigma * sigma)
        return np.where(count >= min_count, limit, np.nan), med

    def state_dict(self) -> dict:
        """JSON-compatible: readings as lists with None for gaps."""
        buf = self.buf.astype(object)
        buf[np.isnan(self.buf)] = None
        return {
            "metrics": list(self.metrics),
            "window": self.window,
            "pos": self.pos.tolist(),
            "buf": buf.tolist(),
        }

    def load_state_dict(self, d: dict) -> None:
        if tuple(d.get("metrics", ())) != self.metrics or int(d.get("window", -1)) != self.window:
            raise ValueError(
                f"history state is for metrics {d.get('metrics')} window {d.get('window')}, "
                f"not {list(self.metrics)} window {self.window}"
            )
        self.pos = np.asarray(d["pos"], dtype=np.int64)
        buf = np.array(d["buf"], dtype=object).reshape(
            len(self.metrics), self.pos.shape[0], self.window
        )
        buf[buf == None] = np.nan  # noqa: E711 (elementwise on an object array)
        self.buf = buf.astype(np.float64)
        self._table.clear()


def _sigma(sub: np.ndarray, count: np.ndarray, med: np.ndarray) -> np.ndarray:
    """Robust sigma (scaled MAD) of each window around its median."""
    with np.errstate(invalid="ignore"):
        dev = np.sort(np.abs(sub - med[:, None]), axis=1)
        return MAD_TO_SIGMA * quantile_sorted(dev, count, 0.5)


def _is_range(ranks: np.ndarray) -> bool:
    """``ranks`` is 0, 1, ..., k - 1 (then the rows are a view of the buffer, no copy)."""
    return bool(np.array_equal(ranks, np.arange(ranks.shape[0])))

"""``RankHistory.assess`` answers many-rank calls from a per-metric table of every rank's
statistics, kept until the next ``learn``: the answer must be the one computed for the
asked ranks alone, for any ranks (unknown, negative, repeated) and after every learn."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.history import RankHistory


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)  # NaN equals NaN here, bit for bit otherwise


def test_the_table_gives_each_rank_its_own_statistics():
    rng = np.random.default_rng(7)
    hist = RankHistory(("a", "b"), window=8)
    asks = [np.arange(200), rng.permutation(300) - 50, np.repeat(np.arange(70), 2),
            np.arange(1 << 20, (1 << 20) + 80)]  # fmt: skip
    for ranks in asks:  # before anything is learnt: counts 0, NaN statistics
        _same(hist.assess(ranks, "a"), hist._stats(ranks, "a"))
        _same(hist.median(ranks, "a"), hist._stats(ranks, "a")[:2])
    for step in range(12):
        ranks = np.arange(180)
        vals = {"a": rng.normal(1.0, 0.1, 180), "b": rng.normal(5.0, 1.0, 180)}
        vals["a"][rng.integers(0, 180, 9)] = np.nan
        vals["b"][rng.integers(0, 180, 3)] = np.inf
        clean = rng.random(180) > 0.1
        hist.learn(ranks, vals, clean)
        # "b"'s table first built without its sigma: assess below must add the right one
        _same(hist.median(asks[1], "b"), hist._stats(asks[1], "b")[:2])
        for ask in asks:
            for metric in ("a", "b"):
                first = hist.assess(ask, metric)
                _same(first, hist._stats(ask, metric))
                _same(hist.assess(ask, metric), first)  # the table's second answer
                _same(hist.median(ask, metric), first[:2])  # and without the sigma
        if step == 6:  # restored state: the table is rebuilt from it
            other = RankHistory(("a", "b"), window=8)
            other.assess(np.arange(100), "a")
            other.load_state_dict(hist.state_dict())
            _same(other.assess(np.arange(100), "a"), hist.assess(np.arange(100), "a"))

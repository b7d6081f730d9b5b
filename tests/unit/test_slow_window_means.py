"""``SlowWindow.means`` from its running sums equals the mean gathered from the rings,
through a non-finite reading, a rank that misses steps, growth and a checkpoint."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.slow_window import SlowWindow


def _gathered(ws: SlowWindow, ranks: np.ndarray, w: int):
    rc, cols, ok = ws._last(ranks, w)
    k = np.maximum(ok.sum(axis=1), 1)
    lr = np.where(ok, ws.lr[cols, rc], 0.0).sum(axis=1) / k
    ex = np.where(ok, ws.ex[cols, rc], 0.0).sum(axis=1) / k
    return lr, ex


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    f = np.isfinite(a)
    np.testing.assert_allclose(a[f], b[f], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(a[~f & ~np.isnan(a)], b[~f & ~np.isnan(b)])


def _check(ws: SlowWindow, n: int) -> None:
    ranks = np.arange(n)
    for w in ws.lengths:
        for got, want in zip(ws.means(ranks, np.full(n, w)), _gathered(ws, ranks, w),
                             strict=True):  # fmt: skip
            _same(got, want)


def test_running_means_match_the_rings_through_odd_readings_and_a_checkpoint():
    rng = np.random.default_rng(3)
    ws = SlowWindow((4, 8, 16), clip=4.0, history=32, min_steps=4)
    n = 6
    for step in range(60):
        if step == 30:
            n = 9  # new ranks join: the window grows
        ranks = np.arange(n) if step % 7 else np.arange(n)[np.arange(n) != 2]  # rank 2 misses
        k = ranks.shape[0]
        z = rng.normal(size=k)
        lr = rng.normal(0.1, 0.05, size=k)
        ex = rng.normal(0.01, 0.002, size=k)
        if step == 20:
            lr[ranks == 1] = -np.inf  # compute 0: a log ratio of -inf, with a finite z
        if step == 24:
            ex[ranks == 3] = np.nan
        if step == 40:
            z[ranks == 4] = np.nan  # no reading
        ws.update(ranks, z, lr, ex, np.ones(k))
        _check(ws, n)
        if step in (22, 26):  # the odd readings are inside some windows: gathered for them
            assert ws.odd.sum() > 0
    assert ws.odd.sum() == 0  # all out of every window again
    back = SlowWindow((4, 8, 16), clip=4.0, history=32, min_steps=4)
    back.load_state_dict(ws.state_dict())
    np.testing.assert_allclose(back.lr_sums, ws.lr_sums, rtol=0, atol=1e-12)
    np.testing.assert_allclose(back.ex_sums, ws.ex_sums, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(back.odd, ws.odd)
    _check(back, n)

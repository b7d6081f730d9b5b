"""Late arrival that the rank's own work does not explain, averaged over a few steps.

Design notes: docs/detectors.md, "detectors/network/late_window.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.consensus import peer_consensus
from rankscope.detectors.stats.slow_window import SlowWindow, z_threshold

__all__ = ["late_residual_hits"]


def late_residual_hits(idx, ranks, lat, own, usual, ws: SlowWindow, *, floor_s: float,
                       chance: float, reach=None):
    """(hit mask, window mean excess residual seconds, this step's residuals) per row.

    ``lat``: arrival lateness (s, NaN where unknown); ``own``: the row's compute
    + input time (s), None where its work does not bear on ``lat``; ``usual``: each
    rank's usual residual in clean steps (its clock offset and habits; NaN until
    learnt, and then the rank is not judged); ``reach``: per row, the share of its
    work its lateness was measured after (``Waits.reach``; NaN or None: all of it).
    Extra work explains lateness up to the lateness itself, a shortfall of work only
    by that share: both err towards naming no network fault (beside a straggler, a
    healthy rank that computed less was "late for its work", and the straggler,
    "early for its work", pulled a small group's median residual down; the figures
    are in docs/detectors.md).
    """
    n = ranks.shape[0]
    with np.errstate(invalid="ignore"):
        extra = None if own is None else own - peer_consensus(idx, own).median[0]
        if extra is not None and reach is not None:  # more work: all of it, to err quiet
            extra = extra * np.where((extra < 0) & np.isfinite(reach), reach, 1.0)
        if extra is not None:  # but no more than the lateness it explains
            extra = np.where(extra > 0, np.minimum(extra, np.maximum(lat, 0.0)), extra)
        raw = lat if extra is None else lat - extra
        resid = raw - usual
    c = peer_consensus(idx, resid)
    count = c.count[0]
    with np.errstate(invalid="ignore"):
        dev = resid - c.median[0]
    z, scale = ws.standardize(idx, dev, count, c.group_scale[0])
    res = ws.update(ranks, z, np.zeros(n), dev, scale)
    hit = np.zeros(n, dtype=bool)
    mean = np.zeros(n)
    known = (ranks >= 0) & (ranks < ws.active.shape[0])
    held = np.zeros(n, dtype=bool)
    held[known] = ws.active[ranks[known]]
    with np.errstate(invalid="ignore"):
        fresh = res.z > z_threshold(n, len(ws.lengths), chance)
    rows = np.flatnonzero(fresh | held)
    if rows.size == 0:
        return hit, mean, raw
    ok, _, _, ex, _ = ws.qualify(
        ranks[rows], scale[rows], held[rows], z_threshold(n, len(ws.lengths), chance),
        lambda _lr, ex: ex > floor_s, lambda _lr, ex: ex > 0.5 * floor_s,
    )
    # A named rank stays named on its longest window, which still holds the
    # delayed steps for a long window after the delay ends, or on its shortest
    # one at half the floor (a delay younger than the longest window); it is
    # released once its shortest window has dropped under half the floor (the
    # last few steps are back to normal), so the incident ends where the delay did.
    _, recent = ws.means(ranks[rows], np.full(rows.size, ws.lengths[0]))
    with np.errstate(invalid="ignore"):
        ok &= ~(held[rows] & (recent < 0.5 * floor_s))
    hit[rows[ok]] = True
    mean[rows] = np.where(ok, ex, 0.0)
    if hit.any():  # strict healthy majority within each group
        n_hit = np.bincount(idx.row_gid, weights=hit.astype(float), minlength=idx.n_groups)
        hit &= ((count - idx.rows(n_hit)) * 2 > count) & (count >= 3)
    ws.active[ranks[rows[held[rows] & ~hit[rows]]]] = False
    ws.active[ranks[hit & known]] = True
    return hit, mean, raw

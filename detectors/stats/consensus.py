"""Symmetric consensus: score every rank against its peer group, all metrics at once.

Design notes: docs/detectors.md, "detectors/stats/consensus.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.stats.peers import PeerIndex
from rankscope.detectors.stats.robust import group_stats, robust_z

__all__ = [
    "excess_floor_s",
    "Consensus",
    "peer_consensus",
    "frame_consensus",
    "readings",
    "strict_majority",
    "group_min",
    "step_reference_s",
    "Z_CAP",
]

Z_CAP = 1000.0  # scores are clipped to +-Z_CAP so infinities stay storable


@dataclass(slots=True)
class Consensus:
    """Per metric and row (shape ``(metrics, n)``): peer median, sigma, count, robust z."""

    x: np.ndarray
    median: np.ndarray
    scale: np.ndarray
    count: np.ndarray
    z: np.ndarray
    group_median: np.ndarray  # (metrics, groups): the medians themselves, once per group
    group_scale: np.ndarray | None = None  # (metrics, groups): robust sigma, once per group

    def scores(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """metric -> clipped z over rows (NaN where not scored), for the heatmap."""
        z = np.clip(self.z, -Z_CAP, Z_CAP)
        return {name: z[i] for i, name in enumerate(names)}


def peer_consensus(idx: PeerIndex, x: np.ndarray) -> Consensus:
    """Robust peer statistics of ``x`` (metrics, n) broadcast back to rows."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    stats = group_stats(idx.matrix(x))
    median = idx.rows(stats.median)
    scale = idx.rows(stats.scale)
    count = idx.rows(stats.count)
    z = robust_z(x, median, scale)
    if stats.count.size and stats.count.min() < 3:  # fewer than three peers: no consensus
        z = np.where(count >= 3, z, np.nan)
    return Consensus(
        x=x,
        median=median,
        scale=scale,
        count=count,
        z=z,
        group_median=stats.median,
        group_scale=stats.scale,
    )


def frame_consensus(frame: StepFrame, idx: PeerIndex, names: tuple[str, ...]) -> Consensus:
    """``peer_consensus`` of the frame's columns ``names`` over ``idx``'s groups, once per
    frame: the straggler's window and lead rules and the network detector all judge
    ``comm_s`` against the same peers. The result is shared, so callers only read it."""
    key = ("consensus", tuple(names))
    for got_idx, got in frame._memo.get(key, ()):
        if got_idx is idx or np.array_equal(got_idx.group, idx.group):
            return got
    got = peer_consensus(idx, readings(frame, names))
    frame._memo.setdefault(key, []).append((idx, got))
    return got


def readings(frame: StepFrame, names) -> np.ndarray:
    """``(len(names), n)`` readings of the step's ranks; NaN where one is not reported."""
    nan = np.full(frame.n, np.nan)
    return np.stack([frame.m.get(name, nan) for name in names])


def strict_majority(idx: PeerIndex, flagged: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per row: True where the unflagged ranks of its group are more than half of it."""
    flagged = np.atleast_2d(flagged)
    if not flagged.any():
        return count > 0
    per_group = idx.matrix(flagged.astype(np.float64), fill=0.0).sum(axis=-1)
    n_flagged = idx.rows(per_group)
    return (count - n_flagged) * 2 > count


def group_min(idx: PeerIndex, x: np.ndarray) -> np.ndarray:
    """Per row: the smallest finite value of its group (NaN when none)."""
    mat = idx.matrix(np.where(np.isfinite(x), x, np.inf), fill=np.inf)
    low = mat.min(axis=-1)
    return idx.rows(np.where(np.isfinite(low), low, np.nan))


def excess_floor_s(frame: StepFrame, cfg) -> float:
    """Seconds a deviation must exceed (``cfg`` a ConsensusConfig): ``min_excess_s``,
    and ``min_excess_step_frac`` of the step (a few ms do not count in a long step)."""
    return max(cfg.min_excess_s, cfg.min_excess_step_frac * step_reference_s(frame))


def step_reference_s(frame: StepFrame) -> float:
    """Typical step time of this step: median step_s, else the sum of the median parts.

    Floors scaled by it keep a few milliseconds from counting in a long step. Once per
    frame (``StepFrame.memo``): most detectors ask for it, some more than once.
    """
    return frame.memo("step_reference_s", _step_reference_s)


def _step_reference_s(frame: StepFrame) -> float:
    for cols in (("step_s",), ("compute_s", "comm_s", "data_s")):
        vals = [frame.m[c] for c in cols if c in frame.m and np.isfinite(frame.m[c]).any()]
        if vals:
            return float(sum(np.nanmedian(v) for v in vals))
    return 0.0

"""Two peers: which one is the straggler, when their own histories say so.

Two members of a peer group cannot outvote each other (a stage of a pp 2 x dp 2
job, a dp 2 job): the slower one is slow against the other, and the other is
fast against it. Their own histories break the tie. The slower one is named
when it is at least ``history_ratio`` over its own clean median, the other is
under ``history_ratio`` over its own and short of the slower one's own ratio by
``min_ratio`` (it did not slow down as well: a job-wide slowdown moves both),
and the other waited for it (``pair_waits``: by ``lead_wait_frac`` of the gap, in the
collectives the two share, or through its pipeline's transfers): a rank that
merely computed more because a crowded host moved CPU time to it makes nobody wait.
Only compute is judged so (a few milliseconds of input wait are noise beside a
peer's wait). Such steps count toward the pair streak like the others, and
toward a streak of their own whose chance rate is their own (named steps are
rarer than flagged ones, so fewer in a row confirm); a rank named so stays named
while its pair keeps flagging it and its leaky count of named steps lasts (the
detector's ``pair_named``). Otherwise the pair stays unattributed.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.network.waits import (
    POINT_TO_POINT,
    SYMMETRIC,
    axis_key,
    collective_instances,
    held_after_others,
)
from rankscope.detectors.stats.peers import PeerIndex

__all__ = ["pair_named", "other_member", "pair_waits", "waiting_s"]


def waiting_s(frame: StepFrame) -> np.ndarray | None:
    """Per row, ``comm_s`` less the time it stayed inside a collective after every other
    member had returned: a slow link's own time there is no wait for its partner (in
    pp slow-link runs the link's stage partner was named a straggler on it). None
    without ``comm_s``."""
    comm = frame.m.get("comm_s")
    if comm is None or not frame.collectives or not any(frame.collectives):
        return comm
    return comm - np.nan_to_num(held_after_others(frame), nan=0.0)


def pair_waits(frame: StepFrame, rows: np.ndarray, other: np.ndarray,
               gap: np.ndarray) -> np.ndarray | None:  # fmt: skip
    """Per pair, how much longer ``other`` waited for ``rows`` than the reverse: the
    ``comm_s`` difference (``waiting_s``), at most how much later ``rows`` arrived at
    the symmetric collectives the two share alone (their group's; ``_shared_lateness``)
    or, when more, how much longer the rest of its pipeline waited in point-to-point
    transfers than the rest of the other's (``_pipeline_waits``), taken only where
    the step's compute ``gap`` is positive and up to it (the larger of two noisy
    readings leans high; past the gap it says no more). In a pp stage ``comm_s``
    also holds a rank's wait for its own upstream stage, which says nothing of who
    is slow in the pair: a stage-1 rank whose replica's stage 0 straggled was named
    on it. None without ``comm_s`` or collectives."""
    comm = waiting_s(frame)
    shared = frame.memo("pair_shared_lateness", _shared_lateness)
    if comm is None and not shared:
        return None
    out = comm[other] - comm[rows] if comm is not None else np.full(rows.size, np.nan)
    piped = frame.memo("pair_pipeline_waits", _pipeline_waits)
    for j, (a, b) in enumerate(zip(rows.tolist(), other.tolist(), strict=True)):
        late = shared.get((a, b))
        if late is None:
            continue
        if piped is not None and gap[j] > 0:  # or its pipeline waited for it, not the partner
            late = max(late, min(piped[a] - piped[b], gap[j]))
        out[j] = late if not np.isfinite(out[j]) else min(out[j], late)
    return out


def _pipeline_waits(frame: StepFrame) -> np.ndarray | None:
    """Per row: the seconds the other ranks of its pipeline (equal coordinates but
    ``pp``) spent in point-to-point transfers this step; None without pipeline stages.

    A stage's two replicas may share no collective their lag shows in: under FSDP 2 x
    PP 2 (torchtitan) a slow stage-0 replica's gather and scatter with its partner sit
    where both wait for their own pipelines anyway, and its lag lands on its
    downstream stage's receives instead (0.20 s a step there against 0.02 s in the
    partner's pipeline, for a 0.17 s sleep). Which rank a receive waited for is not
    recorded (pipeline schedules use the world group); whose pipeline waited is."""
    pp = frame.coords.get("pp")
    if pp is None or np.unique(pp).size < 2 or not frame.collectives:
        return None
    own = np.zeros(frame.n)
    for row, colls in enumerate(frame.collectives):
        for c in colls or ():
            s = c.get("s") if c.get("op") in POINT_TO_POINT else None
            if isinstance(s, (int, float)) and np.isfinite(s) and s > 0:
                own[row] += s
    _, inv = np.unique(axis_key(frame, "pp"), return_inverse=True)
    return np.bincount(inv, weights=own)[inv] - own


def _shared_lateness(frame: StepFrame) -> dict[tuple[int, int], float]:
    """(row a, row b) -> how much later a arrived than b (``t0``; without it, b's time
    inside over a's) at the step's two-member symmetric collectives of exactly a and
    b: the sum of its late arrivals, or, when it was early at each, the least early.

    Summed, not the last one's: a rank that holds two pipeline stages all-reduces
    each, and its partner waits out part of the lag at each (under the interleaved
    schedule all of it at the first, the two then arriving together at the second;
    under the V-shaped one about half at each). DDP's buckets repeat one growing
    lag, so there the sum overstates it and the ``comm_s`` difference is the
    smaller. Both orders are keys."""
    late_sum: dict[tuple[int, int], float] = {}
    least: dict[tuple[int, int], float] = {}
    if not frame.collectives:
        return {}
    for members in collective_instances(frame).values():
        if len(members) != 2 or not all(m[3] in SYMMETRIC for m in members):
            continue
        (ra, sa, ta, _), (rb, sb, tb, _) = sorted(members)
        if ra == rb:
            continue
        if np.isfinite(ta) and np.isfinite(tb):
            late = ta - tb
        elif np.isfinite(sa) and np.isfinite(sb):
            late = sb - sa
        else:
            continue
        for key, v in (((ra, rb), late), ((rb, ra), -late)):
            late_sum[key] = late_sum.get(key, 0.0) + max(v, 0.0)
            least[key] = max(least.get(key, -np.inf), v)
    return {k: (late_sum[k] if late_sum[k] > 0 else least[k]) for k in least}


def other_member(idx: PeerIndex, rows: np.ndarray) -> np.ndarray:
    """The other member of each row's two-member group."""
    total = np.bincount(idx.row_gid, weights=np.arange(idx.n, dtype=np.float64),
                        minlength=idx.n_groups)  # fmt: skip
    return (total[idx.row_gid[rows]] - rows).astype(np.int64)


def pair_named(frame: StepFrame, idx: PeerIndex, state, cfg, i: int, rows: np.ndarray,
               x: np.ndarray, hmed: np.ndarray) -> np.ndarray:  # fmt: skip
    """Of ``rows`` (the slower of two peers on metric ``i``; ``hmed`` their clean
    medians), those their own histories and their peers' waits single out."""
    other = other_member(idx, rows)
    count, ohmed, _ = state.history.assess(frame.rank[other], cfg.metrics[i])
    with np.errstate(invalid="ignore", divide="ignore"):
        own, theirs = x[i, rows] / hmed, x[i, other] / ohmed
        ok = (count >= cfg.history_min_steps) & (own > cfg.history_ratio)
        ok &= (theirs < cfg.history_ratio) & (theirs * cfg.min_ratio < own)  # not both
        gap = x[i, rows] - x[i, other]
        wait = pair_waits(frame, rows, other, gap)
        if wait is not None:
            ok &= (wait >= cfg.lead_wait_frac * gap) | ~np.isfinite(wait)
    return ok

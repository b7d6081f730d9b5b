"""The fast rule for two peers: a lead over the partner and over its own history.

The fast rule (``lead.py``) needs a group of three or more: a median the slow
rank does not move. Two peers (the replicas of a pp stage, a dp 2 job) have
none, and their streak rules (``pair.py``, ``pair_gap.py``) waited 4-10 steps
for a held 1.5x straggler. Here the rank's own clean median stands in for the
group's, and the partner for every other member: a lead is compute of
``lead_mild_ratio`` over its own median and ``pair_lead_over`` over the
partner's (strong: ``lead_ratio``, ``pair_lead_strong_over``: with one other
member, a crowded host's stall of one replica leads it by the group rule's
margins far more often than it leads three peers), an excess of
``lead_step_frac`` of the step and ``lead_z`` of its own learnt spread, a
partner that did not slow down as well and waited for it (``pair_waits``: by
``lead_wait_frac`` of the gap). The leads go through the fast rule's own runs,
warm-up and chance record (``lead.py``, ``lead_chance.py``). Batches of unequal
length are judged as the streak rules judge them: compute per median batch from the
learnt token model (``token_model.py``); until it is ready for both, a rank whose batch
holds more tokens than its partner's is allowed that share.
Design notes: docs/detectors.md, "detectors/straggler/pair_lead.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.gpu.readings import has_gpu, throttled
from rankscope.detectors.stats.consensus import Consensus, step_reference_s
from rankscope.detectors.stats.peers import PeerIndex
from rankscope.detectors.straggler.pair import other_member, pair_waits

__all__ = ["pair_lead_hits"]


def pair_lead_hits(frame: StepFrame, idx: PeerIndex, c: Consensus, i: int, cfg, history,
                   batch=None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(strong, mild): rows of two-member groups whose metric ``i`` (compute) leads the
    partner and their own clean median this step by the fast rule's strong, or at least
    its mild, margins (see the module); ``history``: the detector's clean histories;
    ``batch``: (compute per median batch, rows the token model scaled) or None."""
    n = frame.n
    none = np.zeros(n, dtype=bool)
    if not cfg.pair_lead_strong_over:
        return none, none
    x, scaled = c.x[i], np.zeros(n, dtype=bool)
    if batch is not None and batch[1] is not None:
        x, scaled = batch
    rows = np.flatnonzero((c.count[i] == 2) & np.isfinite(x))
    if not rows.size:
        return none, none
    other = other_member(idx, rows)
    slower = x[rows] > x[other]
    rows, other = rows[slower], other[slower]
    if not rows.size:
        return none, none
    metric = cfg.metrics[i]
    count, hmed, hsig = history.assess(frame.rank[rows], metric)
    ocount, ohmed, _ = history.assess(frame.rank[other], metric)
    xr, xo = x[rows], x[other]
    share = np.ones(rows.size)
    tokens = frame.m.get("tokens")
    if tokens is not None:  # no model for the pair yet: a longer batch is allowed its share
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = tokens[rows] / tokens[other]
        unscaled = ~(scaled[rows] & scaled[other])
        share = np.where(np.isfinite(rel) & unscaled, np.maximum(rel, 1.0), 1.0)
    ref = step_reference_s(frame)
    with np.errstate(invalid="ignore", divide="ignore"):
        own = xr / (hmed * share)
        theirs = xo / ohmed
        over = xr / (xo * share)
        excess = xr - hmed * share
        ok = (count >= cfg.history_min_steps) & (ocount >= cfg.history_min_steps)
        ok &= (theirs < cfg.history_ratio) & (theirs * cfg.min_ratio < own)  # not both
        ok &= excess > max(cfg.min_excess_s, cfg.lead_step_frac * ref)
        if cfg.lead_z > 0:
            ok &= excess >= cfg.lead_z * hsig
        gap = xr - xo
        wait = pair_waits(frame, rows, other, gap)
        if wait is None:
            return none, none  # no waits seen: nothing confirms a lead
        ok &= np.isfinite(wait) & (wait >= cfg.lead_wait_frac * gap)
        mild = ok & (own >= cfg.lead_mild_ratio) & (over >= cfg.pair_lead_over)
        strong = ok & (own >= cfg.lead_ratio) & (over >= cfg.pair_lead_strong_over)
    out_mild, out_strong = none.copy(), none.copy()
    out_mild[rows], out_strong[rows] = mild, strong
    if out_mild.any() and has_gpu(frame):  # a throttling GPU is the GPU detector's finding
        out_mild &= ~throttled(frame)
        out_strong &= out_mild
    return out_strong, out_mild

"""The fast straggler rule: a large lead over every peer that the peers' waits confirm.

The streak rules wait until chance streaks are unlikely, which on a noisy host
takes several steps. A rank whose compute is well above its group's median AND
above every other member's, for ``lead_steps`` steps in a row, while its peers
spent that excess waiting in collectives (their ``comm_s`` over its own), is
slow beyond what noise on a shared host gives: it is reported at once (the
incident starts as ``observe`` and the policy escalates it as it lasts). One
of those steps must be a strong lead (``lead_ratio``, ``lead_over_peers``), the
others may be mild ones (``lead_mild_*``, every other test passed): a 1.5x
straggler on a noisy host measures 1.2-1.9x step to step, and two strong
leads in a row waited for a lucky pair. When every rank reports ``tokens``, a
long batch's share of compute is allowed for.
The excess must also be ``lead_step_frac`` of the step (the job pays for it)
and ``lead_z`` of the group's learnt spread (the windowed test's per-step z): a
loop whose short compute jitters by a third asks a larger lead than a steady
one. A rank whose GPU reports a thermal or power throttle is left to the GPU
detector, as in the windowed test.
Design notes: docs/detectors.md, "detectors/straggler/lead.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.gpu.readings import (
    POWER_EVENTS,
    THERMAL_EVENTS,
    any_event,
    clock_events,
    has_gpu,
)
from rankscope.detectors.stats.consensus import (
    Consensus,
    frame_consensus,
    peer_consensus,
    step_reference_s,
)
from rankscope.detectors.stats.peers import PeerIndex

__all__ = ["lead_hits"]


def _second_largest(idx: PeerIndex, x: np.ndarray) -> np.ndarray:
    """Per row: the largest value among the OTHER members of its group (NaN: none)."""
    mat = idx.matrix(np.where(np.isfinite(x), x, -np.inf), fill=-np.inf)
    top2 = np.sort(mat, axis=-1)[..., -2:] if mat.shape[-1] >= 2 else None
    if top2 is None:
        return np.full(x.shape, np.nan)
    first, second = idx.rows(top2[..., 1]), idx.rows(top2[..., 0])
    other = np.where(x >= first, second, first)  # the row itself is the max: the runner-up
    return np.where(np.isfinite(other), other, np.nan)


def lead_hits(frame: StepFrame, idx: PeerIndex, c: Consensus, i: int, cfg,
              step_z: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(strong, mild): rows whose metric ``i`` (compute) leads its group this step by
    the strong or at least the mild margins (see the module; strong rows are mild too);
    ``step_z``: this step's z over the group's learnt spread (NaN, or None: not learnt
    yet, and nothing leads)."""
    x, med = c.x[i], c.median[i]
    with np.errstate(invalid="ignore"):
        lead = (c.count[i] >= 3) & (x >= cfg.lead_mild_ratio * med)
        if not lead.any():
            return lead, lead
        tokens = frame.m.get("tokens")
        expected = med
        if tokens is not None and np.isfinite(tokens).all() and (tokens > 0).all():
            tok_med = peer_consensus(idx, tokens).median[0]
            expected = med * np.maximum(1.0, tokens / tok_med)  # a long batch takes longer
        # an excess that costs the whole job a share of its step (noise in a short
        # compute next to long waits is large relative to the compute, not to the step)
        floor = max(cfg.min_excess_s, cfg.lead_step_frac * step_reference_s(frame))
        lead &= (x >= cfg.lead_mild_ratio * expected) & (x - expected > floor)
        runner_up = _second_largest(idx, x)
        lead &= x >= cfg.lead_mild_over_peers * runner_up
        if cfg.lead_z > 0:
            lead &= (step_z >= cfg.lead_z) if step_z is not None else False
        comm = frame.m.get("comm_s")
        if not lead.any() or comm is None or not np.isfinite(comm).any():
            return lead & False, lead & False  # nothing leads, or no waits to confirm it
        peer_comm = frame_consensus(frame, idx, ("comm_s",)).median[0]
        lead &= peer_comm - comm >= cfg.lead_wait_frac * (x - med)
        strong = lead & (x >= cfg.lead_ratio * expected) & (x >= cfg.lead_over_peers * runner_up)
    if lead.any() and has_gpu(frame):  # a throttling GPU is the GPU detector's finding
        lead &= ~any_event(clock_events(frame), THERMAL_EVENTS + POWER_EVENTS)
        strong &= lead
    return strong, lead

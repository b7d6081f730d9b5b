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
A longer run (``lead_long_steps``) may be of looser leads (``lead_long_*``: a
smaller lead, a share of the waits, a smaller z), one of them strong (its
margins and z; its waits and step share the long run's): on a crowded host a
slow rank's compute and its peers' waits jitter through the mild margins, and
three leads in a row by chance are rarer than two mild ones.
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
from rankscope.detectors.gpu.readings import has_gpu, throttled
from rankscope.detectors.stats.consensus import (
    Consensus,
    frame_consensus,
    peer_consensus,
    step_reference_s,
)
from rankscope.detectors.stats.peers import PeerIndex
from rankscope.detectors.straggler.pair_lead import pair_lead_hits

__all__ = ["lead_hits", "leading"]


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
              step_z: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """(strong, mild, long): rows whose metric ``i`` (compute) leads its group this step
    by the strong, at least the mild, or at least the long run's margins (see the
    module; mild and strong leads are long ones, a strong one need not be mild);
    ``step_z``: this step's z over the group's learnt spread (NaN, or None: not learnt
    yet, and nothing leads)."""
    x, med = c.x[i], c.median[i]
    with np.errstate(invalid="ignore"):
        cand = (c.count[i] >= 3) & (x >= cfg.lead_long_ratio * med)
        if not cand.any():
            return cand, cand, cand
        tokens = frame.m.get("tokens")
        expected = med
        if tokens is not None and np.isfinite(tokens).all() and (tokens > 0).all():
            tok_med = peer_consensus(idx, tokens).median[0]
            expected = med * np.maximum(1.0, tokens / tok_med)  # a long batch takes longer
        # an excess that costs the whole job a share of its step (noise in a short
        # compute next to long waits is large relative to the compute, not to the step)
        ref = step_reference_s(frame)
        floor = max(cfg.min_excess_s, cfg.lead_step_frac * ref)
        excess = x - expected
        long = cand & (x >= cfg.lead_long_ratio * expected)
        long &= excess > max(cfg.min_excess_s, cfg.lead_long_step_frac * ref)
        runner_up = _second_largest(idx, x)
        long &= x >= cfg.lead_long_over_peers * runner_up
        long_z = min(cfg.lead_long_z, cfg.lead_z)  # never asks more than a mild lead
        if long_z > 0:
            long &= (step_z >= long_z) if step_z is not None else False
        comm = frame.m.get("comm_s")
        if not long.any() or comm is None or not np.isfinite(comm).any():
            return long & False, long & False, long & False  # no lead, or no waits seen
        peer_comm = frame_consensus(frame, idx, ("comm_s",)).median[0]
        waited = peer_comm - comm
        long &= waited >= cfg.lead_long_wait_frac * (x - med)
        far = long  # and the z of a mild or strong lead
        if cfg.lead_z > 0:
            far = (long & (step_z >= cfg.lead_z)) if step_z is not None else long & False
        lead = far & (x >= cfg.lead_mild_ratio * expected) & (excess > floor)
        lead &= x >= cfg.lead_mild_over_peers * runner_up
        lead &= waited >= cfg.lead_wait_frac * (x - med)
        # strong: the strong margins and the z; the waits and the step share are the
        # long run's (the two-step rule asks its strong lead to be a mild one too)
        strong = far & (x >= cfg.lead_ratio * expected) & (x >= cfg.lead_over_peers * runner_up)
    if long.any() and has_gpu(frame):  # a throttling GPU is the GPU detector's finding
        long &= ~throttled(frame)
        lead &= long
        strong &= long
    return strong, lead, long


def leading(frame: StepFrame, idx: PeerIndex, c: Consensus, state, cfg, win, batch=None
            ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(named, onset back): rows the fast rule names this step (``lead_steps`` leads in
    a row, or ``lead_long_steps`` looser ones, one of them strong; or
    ``lead_long_alone`` looser ones; each a step longer per naming of this job that came
    to nothing, ``lead_chance.py``), and per row how many steps back its onset is
    (the run's first strong lead: a mild lead just before a fault is as often chance).
    ``state``: the straggler state (its lead counters and streak rates), ``win``: the
    windowed test's result this step (its per-step z), ``batch``: (compute per median
    batch, rows the token model scaled) for the two-peer rule (``pair_lead.py``)."""
    n = frame.n
    if not (cfg.lead_steps and cfg.window_metric):
        return np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
    step_z = win.step_z if win is not None else None
    i = cfg.metrics.index(cfg.window_metric)
    strong, lead, long = lead_hits(frame, idx, c, i, cfg, step_z)
    pair_strong, pair_lead = pair_lead_hits(frame, idx, c, i, cfg, state.history, batch)
    if pair_lead.any():  # two peers: against the partner and its own history (pair_lead.py)
        strong, lead, long = strong | pair_strong, lead | pair_lead, long | pair_lead
    if not cfg.lead_long_steps:
        long = lead
    judged = state.streaks.rate[(cfg.window_metric, "slow")].steps
    if long.any() and judged < max(cfg.lead_after, cfg.history_min_steps):
        # the job's first steps (warm-up, loaders starting) teach only, and a lead is
        # judged against a learnt spread too young to tell one rank's hiccup from slowness
        long[:] = lead[:] = strong[:] = False
    elif long.any() and judged < cfg.lead_mild_after:
        long &= strong  # the learnt spread is young: only strong leads count
        lead &= strong
    if not (long.any() or state.lead.count.any() or state.lead_long.count.any()):
        state.lead_chance.update(frame.rank, np.zeros(n, dtype=bool), cfg.lead_chance_quiet)
        return lead, np.zeros(n, dtype=np.int64)
    extra = state.lead_chance.extra(cfg.lead_chance_cap)  # this job's chance namings
    fired, since = _lead_run(frame, state.lead, state.lead_strong, lead, strong,
                             cfg.lead_steps + extra)  # fmt: skip
    if cfg.lead_long_steps:
        alone = cfg.lead_long_alone + extra if cfg.lead_long_alone else 0
        more, since_long = _lead_run(frame, state.lead_long, state.long_strong, long, strong,
                                     cfg.lead_long_steps + extra, alone)  # fmt: skip
        since = np.where(fired, since, since_long)  # onset: the run that named it
        fired |= more
    state.lead_chance.update(frame.rank, fired, cfg.lead_chance_quiet)
    return fired, since


def _lead_run(frame, run_count, strong_count, lead, strong, steps: int, alone: int = 0):
    """(named, onset back): rows that led ``steps`` steps in a row, one of them strong
    (the onset: that one), or ``alone`` steps in a row (the onset: the run's first)."""
    run = np.asarray(run_count.update(frame.rank, lead), dtype=np.int64)
    was = strong_count.peek(frame.rank) > 0
    since = np.asarray(strong_count.update(frame.rank, lead & (strong | was)), dtype=np.int64)
    named = lead & (run >= steps) & (since > 0)
    if alone:
        by_run = lead & (run >= alone) & ~named
        named |= by_run
        since = np.where(by_run, run, since)
    return named, since

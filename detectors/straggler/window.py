"""The straggler detector's windowed test: slow on average over a few steps.

Design notes: docs/detectors.md, "detectors/straggler/window.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.gpu.readings import gpu_context, has_gpu, throttled
from rankscope.detectors.signal import Signal
from rankscope.detectors.stats.consensus import (
    Z_CAP,
    excess_floor_s,
    frame_consensus,
    peer_consensus,
)
from rankscope.detectors.stats.robust import group_stats
from rankscope.detectors.stats.slow_window import SlowWindow, z_threshold
from rankscope.detectors.straggler.token_model import TokenModel

__all__ = ["WindowResult", "window_hits", "window_signal", "noise_evidence", "HOLD"]

HOLD = 0.5  # a named rank stays named while its last few steps keep this share of the floors


@dataclass(slots=True)
class WindowResult:
    """Rows named by the windowed test and, for them, the window's statistics."""

    hit: np.ndarray
    z: np.ndarray
    steps: np.ndarray
    ratio: np.ndarray
    excess_s: np.ndarray
    per_token: bool
    step_hit: np.ndarray  # this step alone: far above the learnt spread (see _step_hits)
    step_ratio: np.ndarray  # this step's compute over what its peers predict for it
    step_z: np.ndarray  # the same, as a z over the group's learnt spread (unclipped)
    noise: np.ndarray  # the group's learnt per-step sigma of that log ratio (NaN: not learnt)


def _relative(frame: StepFrame, idx, c, i: int, model: TokenModel | None):
    """(reference seconds, log ratio to it, per-group relative sigma, count) per row.

    Without tokens the reference is the peer median. With tokens it is what
    ``model`` expects for the rank's batch (peer median x (alpha + beta x
    relative tokens)); the log ratio is then centred on the group's median and
    its spread measured directly.
    """
    x, med, count = c.x[i], c.median[i], c.count[i]
    if model is None:
        with np.errstate(invalid="ignore", divide="ignore"):
            return med, np.log(x / med), c.group_scale[i] / c.group_median[i], count
    tokens = frame.m["tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        rel_tokens = tokens / peer_consensus(idx, tokens).median[0]
        model.offer(idx, rel_tokens, x / med)
        expect = model.expected(idx, rel_tokens)
        ref = np.where(np.isfinite(expect) & (expect > 0), med * expect, med)
        log_ratio = np.log(x / ref)
    stats = group_stats(idx.matrix(log_ratio))
    centre = idx.rows(stats.median)
    return ref * np.exp(centre), log_ratio - centre, stats.scale, count


def _uses_tokens(frame: StepFrame, x: np.ndarray, cfg) -> bool:
    tokens = frame.m.get("tokens")
    if not cfg.per_token or tokens is None:
        return False
    have = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(tokens) & (tokens > 0)
    return bool(have.any() and ok[have].all())


def window_hits(frame: StepFrame, idx, c, ws: SlowWindow, model: TokenModel, cfg,
                busy: np.ndarray | None = None) -> WindowResult:  # fmt: skip
    """Advance the windows by this step; rows the windowed test names now. ``busy``:
    rows whose lead this step is work of their own (``expert_load.py``), evidence of
    nothing: their step is left out of the windows and of the group's spread."""
    n = frame.n
    i = cfg.metrics.index(cfg.window_metric)
    x = c.x[i]
    per_token = _uses_tokens(frame, x, cfg)
    ref, log_ratio, rel_sigma, count = _relative(frame, idx, c, i, model if per_token else None)
    if busy is not None and busy.any():  # no reading this step: nothing for or against
        log_ratio = np.where(busy, np.nan, log_ratio)
    with np.errstate(invalid="ignore", divide="ignore"):
        z, scale, raw, sigma = ws.standardize(idx, log_ratio, count, rel_sigma, raw=True)
    res = ws.update(frame.rank, z, log_ratio, x - ref, scale)
    out = WindowResult(
        hit=np.zeros(n, dtype=bool),
        z=res.z,
        steps=res.steps,
        ratio=np.full(n, np.nan),
        excess_s=np.full(n, np.nan),
        per_token=per_token,
        step_hit=np.zeros(n, dtype=bool),
        step_ratio=np.exp(log_ratio),
        step_z=raw,
        noise=sigma * scale,
    )
    with np.errstate(invalid="ignore"):
        far = raw > cfg.z_min
    if far.any():
        out.step_hit = _step_hits(frame, far, log_ratio, x - ref, cfg)
    limit = z_threshold(n, len(ws.lengths), cfg.chance_findings_per_step)
    ranks_ok = (frame.rank >= 0) & (frame.rank < ws.active.shape[0])
    held = np.zeros(n, dtype=bool)
    held[ranks_ok] = ws.active[frame.rank[ranks_ok]]
    with np.errstate(invalid="ignore"):
        fresh = res.z > limit
    rows = np.flatnonzero(fresh | held)
    if rows.size == 0:
        return out
    # any window length that clears the limit and the floors names the rank; a
    # confirmed rank stays named while its longest window keeps the floors, or its
    # shortest window HOLD of them (one incident, not a new one each time the z dips)
    floor = excess_floor_s(frame, cfg)
    ok, steps, mlr, mex, zs = ws.qualify(
        frame.rank[rows], scale[rows], held[rows], limit,
        lambda lr, ex: (lr > math.log(cfg.min_ratio)) & (ex > floor),
        lambda lr, ex: (lr > HOLD * math.log(cfg.min_ratio)) & (ex > HOLD * floor),
    )
    res.steps[rows] = np.where(ok, steps, 0)
    res.z[rows] = np.where(ok & np.isfinite(zs), zs, res.z[rows])
    comm = frame.m.get("comm_s")
    if comm is not None and np.isfinite(comm).sum() >= 3:
        cc = frame_consensus(frame, idx, ("comm_s",))
        with np.errstate(invalid="ignore"):  # a victim waited longer than its peers
            ok &= held[rows] | ~(cc.x[0, rows] > cc.median[0, rows])
    if has_gpu(frame):
        ok &= ~throttled(frame)[rows]
    out.ratio[rows], out.excess_s[rows] = np.exp(mlr), mex
    out.hit[rows[ok]] = True
    if out.hit.any():
        out.hit &= _healthy_majority(idx, ws, frame, res, rows, count, limit, cfg)
    done = rows[held[rows] & ~out.hit[rows]]
    ws.active[frame.rank[done]] = False
    ws.active[frame.rank[out.hit & ranks_ok]] = True
    return out


def _step_hits(frame: StepFrame, far, log_ratio, excess_s, cfg) -> np.ndarray:
    """Rows slow in this one step against what their peers predict for their batch.

    The windowed test's own per-step evidence, unclipped: a rank whose compute
    is ``z_min`` learnt sigmas above its expectation, by the same floors as
    the raw per-step rule. Where the token model explains the batch-to-batch
    spread, this sees a 1.2x rank in one step that raw compute hides for
    dozens; the caller's streak (sized by the chance rate) confirms it.
    Throttled GPUs (the GPU detector's finding) are left out, as in the
    windowed test. Unlike the window, no victim test on ``comm_s``: with
    batches of different lengths a slow rank still waits for a peer that drew
    a longer one, and a victim's own compute is not what this z measures.
    """
    floor = excess_floor_s(frame, cfg)
    with np.errstate(invalid="ignore"):
        hit = far & (log_ratio > math.log(cfg.min_ratio)) & (excess_s > floor)
    if hit.any() and has_gpu(frame):
        hit &= ~throttled(frame)
    return hit


def _healthy_majority(idx, ws: SlowWindow, frame, res, rows, count, limit, cfg) -> np.ndarray:
    """Per row: more than half of its group is NOT slow over the candidates' window.

    A member counts as slow when its own windowed z clears the limit, or when
    its mean ratio over the same window is above ``min_ratio`` (two slow ranks
    of four pull the median up, so only one of them may clear the z limit).
    """
    gid = idx.row_gid
    span = np.zeros(idx.n_groups, dtype=np.int64)
    np.maximum.at(span, gid[rows], np.where(res.steps[rows] > 0, res.steps[rows], 0))
    members = np.flatnonzero(span[gid] > 0)
    mlr, _ = ws.means(frame.rank[members], span[gid[members]])
    with np.errstate(invalid="ignore"):
        slow = (mlr > math.log(cfg.min_ratio)) | (res.z[members] > limit)
    n_slow = np.bincount(gid[members], weights=slow.astype(float), minlength=idx.n_groups)
    return ((count - idx.rows(n_slow)) * 2 > count) & (count >= 3)


def window_signal(frame: StepFrame, idx, c, win: WindowResult, row: int, state, cfg) -> Signal:
    """A straggler signal for a row the windowed test named."""
    i = cfg.metrics.index(cfg.window_metric)
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    _, hmed = state.history.median(frame.rank[row : row + 1], cfg.window_metric)
    steps = int(win.steps[row])
    back = int(state.window.onset_back(frame.rank[row : row + 1], np.array([steps]))[0])
    gpu = gpu_context(frame, row)
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector="straggler",
        score=float(min(win.z[row], Z_CAP)) if np.isfinite(win.z[row]) else 0.0,  # held, few steps
        severity="persistent",
        evidence=metric_evidence(
            cfg.window_metric,
            c.x[i, row],
            c.median[i, row],
            c.x[i, peers],
            history_median=hmed[0],
            z=win.z[row],
            ratio=num(win.ratio[row]),
            rule="window",
            window_steps=steps,
            window_excess_s=num(win.excess_s[row]),
            per_token=win.per_token,
            onset_step=int(frame.step) - back + 1,
            slow_metrics=[cfg.window_metric],
            **noise_evidence(win, row),
            **({"gpu": gpu} if gpu else {}),
        ),
    )


def noise_evidence(win: WindowResult | None, row: int) -> dict:
    """``noise``: the learnt per-step sigma of the rank's log compute ratio in its
    group, the yardstick of how far from chance a slowdown is (the report gate's)."""
    if win is None or not np.isfinite(win.noise[row]) or win.noise[row] <= 0:
        return {}
    return {"noise": num(win.noise[row])}

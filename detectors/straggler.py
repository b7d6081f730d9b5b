"""Stragglers: a rank whose own work (compute, input) is slower than its peers'.

``compute_s`` excludes time blocked in collectives and ``data_s`` is time
waiting for input, so a slow rank shows up in its own numbers while its
victims only wait (that is ``comm_s``, the network detector's business).
Within each peer group a rank is slow when its robust z is high AND it is
clearly slower in absolute terms: at least ``min_ratio`` x the peer median,
``min_excess_s`` more, and an excess worth ``min_excess_step_frac`` of the
step (a 3 ms data hiccup in a 2 s step slows nobody). Only the slow
direction counts. The deviation must build a streak of ``persist_steps``
(a step without it takes one off rather than starting over, so a straggler
hidden by noise now and then still adds up), longer in a job where
isolated deviations are common (``FlagRate``: a streak that chance alone
would produce is not evidence).

Attribution needs a strict healthy majority of the group. Two peers that
disagree are reported unattributed (both ranks, no blame). A rank without
peers is judged against its own clean history (slow above max(ratio x
median, median + k x sigma)), and only while most such ranks are not slow
at once (then it is the workload, not a rank).

Not blamed, by construction: a pipeline stage slower than other stages on
all its dp peers (stages are different groups), per-step noise (absorbed in
the peer sigma and by persistence), a rank a few percent slower (ratio floor).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detectors.consensus import (
    Z_CAP,
    group_min,
    peer_consensus,
    step_reference_s,
    strict_majority,
)
from detectors.evidence import metric_evidence, num
from detectors.frame import StepFrame
from detectors.gpu_readings import gpu_context
from detectors.history import RankHistory
from detectors.peers import PeerCache
from detectors.persistence import FlagRate, StreakCounter
from detectors.signal import DetectorOutput, Signal
from detectors.slow_window import SlowWindow
from detectors.straggler_window import window_hits, window_signal
from detectors.token_model import TokenModel

__all__ = ["StragglerConfig", "StragglerState", "detect"]

NAME = "straggler"


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """Settings of the straggler detector (times in seconds)."""

    metrics: tuple[str, ...] = ("compute_s", "data_s")  # per-rank work times judged
    z_min: float = 3.5  # robust z above the peer median to count as slow
    min_ratio: float = 1.1  # and at least this multiple of the peer median
    min_excess_s: float = 0.002  # and at least this many seconds above it
    min_excess_step_frac: float = 0.03  # and at least this share of the median step time
    persist_steps: int = 2  # consecutive slow steps before a finding (in a quiet job)
    max_persist_steps: int = 6  # a noisy job asks for longer streaks, up to this
    chance_findings_per_step: float = 1e-4  # tolerated chance streaks per step, whole job
    history_steps: int = 32  # clean steps kept per rank
    history_min_steps: int = 5  # clean steps before the history judges
    history_ratio: float = 1.25  # slow for itself above this multiple of its median
    history_k_sigma: float = 4.0  # or this many robust sigmas above its median
    # windowed test (see straggler_window): per-step log ratios to the peer median,
    # standardized by the group's learnt spread, averaged over windows of these lengths
    window_metric: str = "compute_s"  # "" turns the windowed test off
    window_steps: tuple[int, ...] = (4, 8, 16, 32)
    window_clip: float = 3.0  # one step counts at most this many sigmas
    per_token: bool = True  # expect compute from tokens when every rank reports them

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ValueError("metrics must name at least one column")
        if self.z_min <= 0:
            raise ValueError("z_min must be > 0")
        if self.min_ratio < 1.0 or self.history_ratio < 1.0:
            raise ValueError("min_ratio and history_ratio must be >= 1")
        if self.min_excess_s < 0 or self.min_excess_step_frac < 0:
            raise ValueError("min_excess_s and min_excess_step_frac must be >= 0")
        if not 1 <= self.persist_steps <= self.max_persist_steps:
            raise ValueError("need 1 <= persist_steps <= max_persist_steps")
        if not 0 < self.chance_findings_per_step < 1:
            raise ValueError("chance_findings_per_step must be in (0, 1)")
        if not 1 <= self.history_min_steps <= self.history_steps:
            raise ValueError("need 1 <= history_min_steps <= history_steps")
        if self.history_k_sigma < 0:
            raise ValueError("history_k_sigma must be >= 0")
        if self.window_metric and self.window_metric not in self.metrics:
            raise ValueError("window_metric must be one of metrics (or empty)")
        if not self.window_steps or min(self.window_steps) < 2 or max(self.window_steps) > 256:
            raise ValueError("window_steps must be lengths between 2 and 256")
        if self.window_clip <= 0:
            raise ValueError("window_clip must be > 0")


class StragglerState:
    """Peer index cache, per-rank clean history, and slow streaks."""

    __slots__ = (
        "peers", "history", "streak", "pair_streak", "rate", "pair_rate", "window", "tokens",
    )

    def __init__(self, cfg: StragglerConfig) -> None:
        self.peers = PeerCache()
        self.history = RankHistory(cfg.metrics, cfg.history_steps)
        self.streak = StreakCounter()
        self.pair_streak = StreakCounter()
        self.rate = FlagRate(cfg.history_steps)
        self.pair_rate = FlagRate(cfg.history_steps)
        self.window = SlowWindow(
            cfg.window_steps,
            clip=cfg.window_clip,
            history=cfg.history_steps,
            min_steps=cfg.history_min_steps,
        )
        self.tokens = TokenModel()

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        self.history.learn(frame.rank, frame.m, clean_mask)
        self.tokens.learn(clean_mask)
        self.window.learn(float(np.mean(clean_mask)) if clean_mask.size else 0.0, frame.step)

    def state_dict(self) -> dict:
        return {
            "history": self.history.state_dict(),
            "streak": self.streak.state_dict(),
            "pair_streak": self.pair_streak.state_dict(),
            "rate": self.rate.state_dict(),
            "pair_rate": self.pair_rate.state_dict(),
            "window": self.window.state_dict(),
            "tokens": self.tokens.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.history.load_state_dict(d["history"])
        self.streak.load_state_dict(d.get("streak", {}))
        self.pair_streak.load_state_dict(d.get("pair_streak", {}))
        self.rate.load_state_dict(d.get("rate", {}))
        self.pair_rate.load_state_dict(d.get("pair_rate", {}))
        self.window.load_state_dict(d.get("window", {}))
        self.tokens.load_state_dict(d.get("tokens", {}))


def detect(frame: StepFrame, state: StragglerState, cfg: StragglerConfig) -> DetectorOutput:
    out = DetectorOutput()
    n = frame.n
    if n == 0:
        return out
    idx = state.peers.get(frame.group)
    nan = np.full(n, np.nan)
    x = np.stack([frame.m.get(name, nan) for name in cfg.metrics])
    c = peer_consensus(idx, x)
    out.scores = c.scores(cfg.metrics)
    floor = cfg.min_excess_s
    few = int(c.count.min()) < 3  # some group has fewer than three reporting peers
    with np.errstate(invalid="ignore"):
        slow = c.z > cfg.z_min  # the selective test first; the rest only if needed
        if slow.any():
            slow &= (x > cfg.min_ratio * c.median) & (x - c.median > floor)
        single = ((c.count == 1) & np.isfinite(x)) if few else np.zeros_like(slow)
        if slow.any() or few:  # the step floor costs a median
            floor = max(floor, cfg.min_excess_step_frac * step_reference_s(frame))
            slow &= x - c.median > floor
        hit = slow & strict_majority(idx, slow, c.count) if slow.any() else slow
        pair = np.zeros_like(hit)
        if few and (c.count == 2).any():
            low = group_min(idx, x)
            pair = (c.count == 2) & (x > cfg.min_ratio * low) & (x - low > floor)
            # two peers cannot outvote each other; the slower one must at least be slow
            # for itself too, or it is only the job's noise
            for i, rows in ((i, np.flatnonzero(pair[i])) for i in range(len(cfg.metrics))):
                if rows.size:
                    limit, _ = state.history.slow_limit(
                        frame.rank[rows],
                        cfg.metrics[i],
                        ratio=cfg.history_ratio,
                        k_sigma=cfg.history_k_sigma,
                        min_count=cfg.history_min_steps,
                    )
                    pair[i, rows] = x[i, rows] > limit
        for i in np.flatnonzero(single.any(axis=1)):
            rows = np.flatnonzero(single[i])
            limit, hmed = state.history.slow_limit(
                frame.rank[rows],
                cfg.metrics[i],
                ratio=cfg.history_ratio,
                k_sigma=cfg.history_k_sigma,
                min_count=cfg.history_min_steps,
            )
            s = (x[i, rows] > limit) & (x[i, rows] - hmed > floor)
            if s.sum() * 2 < rows.size:  # most peerless ranks fine: not a workload change
                hit[i, rows] |= s
    dev = hit.any(axis=0)
    if dev.any() or state.streak.count.any():  # else nothing to advance or reset
        prev = state.streak.peek(frame.rank)
        streak = state.streak.update(frame.rank, dev, leaky=True)
        need = _required(state.rate, prev, dev, n, cfg)
        for row in np.flatnonzero(dev & (streak >= need)):
            out.signals.append(
                _signal(frame, idx, c, hit, int(row), state, cfg, int(streak[row]))
            )
    else:
        state.rate.observe(0, n)
    if cfg.window_metric:
        said = {s.ranks[0] for s in out.signals}
        win = window_hits(frame, idx, c, state.window, state.tokens, cfg)
        for row in np.flatnonzero(win.hit):
            if int(frame.rank[row]) not in said:
                out.signals.append(window_signal(frame, idx, c, win, int(row), state, cfg))
    pair_any = pair.any(axis=0)
    if not (pair_any.any() or state.pair_streak.count.any()):
        return out
    pprev = state.pair_streak.peek(frame.rank)
    pstreak = state.pair_streak.update(frame.rank, pair_any, leaky=True)
    pneed = _required(state.pair_rate, pprev, pair_any, n, cfg)
    done: set[int] = set()
    for row in np.flatnonzero(pair_any & (pstreak >= pneed)):
        members = idx.peers_of(int(row))
        key = int(idx.row_gid[row])
        if key in done:
            continue
        done.add(key)
        i = int(np.argmax(np.where(pair[:, row], x[:, row] / c.median[:, row], -np.inf)))
        out.signals.append(
            Signal(
                kind="straggler",
                ranks=tuple(int(r) for r in frame.rank[members]),
                detector=NAME,
                score=float(x[i, row] / c.median[i, row]),
                severity="transient",
                evidence=metric_evidence(
                    cfg.metrics[i],
                    x[i, row],
                    c.median[i, row],
                    x[i, members],
                    slower_rank=int(frame.rank[row]),
                    reason="two peers disagree; no majority to attribute",
                ),
                unattributed=True,
            )
        )
    return out


def _required(rate: FlagRate, prev, hit, rows: int, cfg: StragglerConfig) -> int:
    """Streak needed now (from the chance rate so far); then count streaks chance ended.

    Streaks leak (a miss takes one off), so one ends when it falls from 1 to 0.
    """
    need = rate.required(
        cfg.persist_steps, cfg.max_persist_steps, int(rows), cfg.chance_findings_per_step
    )
    if rate.steps < cfg.history_min_steps:  # the first steps of a job (warm-up) teach only
        need = cfg.max_persist_steps + 1_000_000
    rate.observe(int(np.count_nonzero(~hit & (prev == 1))), int(rows))
    return need


def _signal(frame, idx, c, hit, row, state, cfg, streak) -> Signal:
    """Signal for one confirmed slow row, on its most deviating metric."""
    ratio = np.where(hit[:, row], c.x[:, row] / c.median[:, row], -np.inf)
    peerless = not np.isfinite(ratio).any() or np.all(c.count[:, row] == 1)
    i = int(np.argmax(ratio)) if not peerless else int(np.flatnonzero(hit[:, row])[0])
    metric = cfg.metrics[i]
    _, hmed, _ = state.history.assess(frame.rank[row : row + 1], metric)
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    value = c.x[i, row]
    if peerless:
        score = float(value / hmed[0]) if hmed[0] > 0 else 0.0
    else:
        score = float(min(c.z[i, row], Z_CAP))
    gpu = gpu_context(frame, row)  # a throttling GPU behind the slowness shows here
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector=NAME,
        score=score,
        severity="persistent",
        evidence=metric_evidence(
            metric,
            value,
            c.median[i, row],
            c.x[i, peers],
            history_median=hmed[0],
            z=c.z[i, row],
            ratio=num(value / c.median[i, row]) if not peerless else num(value / hmed[0]),
            slow_metrics=[cfg.metrics[j] for j in np.flatnonzero(hit[:, row])],
            streak_steps=streak,
            **({"gpu": gpu} if gpu else {}),
        ),
    )


CONFIG = StragglerConfig
STATE = StragglerState

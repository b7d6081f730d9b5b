"""Gradient and loss spikes on one rank: silent data corruption in its own work.

Design notes: docs/detectors.md, "detectors/metric_outlier.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.stats.consensus import (
    Z_CAP,
    group_min,
    peer_consensus,
    readings,
    strict_majority,
)
from rankscope.detectors.stats.history import RankHistory
from rankscope.detectors.stats.history_state import PartsState
from rankscope.detectors.stats.peers import PeerCache

__all__ = ["MetricOutlierConfig", "MetricOutlierState", "detect"]

NAME = "metric_outlier"
METRICS = ("grad_norm", "loss")


@dataclass(kw_only=True, slots=True)
class MetricOutlierConfig:
    """Settings of the gradient-norm / loss spike detector."""

    z_min: float = 6.0  # robust z above the peer median
    grad_ratio: float = 4.0  # local grad_norm at least this multiple of peers and own median
    loss_ratio: float = 3.0  # loss at least this multiple of peers and own median
    history_steps: int = 32  # clean steps kept per rank
    history_min_steps: int = 5  # clean steps before the history judges
    history_k_sigma: float = 6.0  # own-history rule: median + k x robust sigma

    def __post_init__(self) -> None:
        if self.z_min <= 0:
            raise ValueError("z_min must be > 0")
        if self.grad_ratio <= 1.0 or self.loss_ratio <= 1.0:
            raise ValueError("grad_ratio and loss_ratio must be > 1")
        if not 1 <= self.history_min_steps <= self.history_steps:
            raise ValueError("need 1 <= history_min_steps <= history_steps")
        if self.history_k_sigma < 0:
            raise ValueError("history_k_sigma must be >= 0")

    def ratios(self) -> np.ndarray:
        return np.array([self.grad_ratio, self.loss_ratio])[:, None]


class MetricOutlierState(PartsState):
    """Peer index cache and per-rank clean history of grad_norm and loss."""

    __slots__ = ("peers", "history")
    PARTS = ("history",)

    def __init__(self, cfg: MetricOutlierConfig) -> None:
        self.peers = PeerCache()
        self.history = RankHistory(METRICS, cfg.history_steps)

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        self.history.learn(frame.rank, frame.m, clean_mask)


def _own_limit(state, cfg, ranks, i) -> tuple[np.ndarray, np.ndarray]:
    return state.history.slow_limit(
        ranks,
        METRICS[i],
        ratio=float(cfg.ratios()[i, 0]),
        k_sigma=cfg.history_k_sigma,
        min_count=cfg.history_min_steps,
    )


def detect(frame: StepFrame, state: MetricOutlierState, cfg: MetricOutlierConfig) -> DetectorOutput:
    """Gradient-norm and loss spikes on one rank against its peers and its own history."""
    out = DetectorOutput()
    if frame.n == 0:
        return out
    idx = state.peers.get(frame.group)
    x = readings(frame, METRICS)
    # a norm that overflowed although the rank counted no non-finite element holds a
    # finite, huge value: the largest spike there is. Other non-finite values are the
    # nonfinite detector's case and are not scored here.
    overflow = ~np.isfinite(x[0]) & (readings(frame, ("nonfinite",))[0] == 0)
    x = np.where(np.isfinite(x), x, np.nan)
    c = peer_consensus(idx, x)
    out.scores = c.scores(METRICS)
    ratio = cfg.ratios()
    few = int(c.count.min()) < 3  # some group has fewer than three reporting peers
    with np.errstate(invalid="ignore"):
        spike = c.z > cfg.z_min  # the selective test first; the rest only if needed
        if spike.any():
            spike &= x > ratio * np.abs(c.median)
        spike[0] |= overflow
        hit = spike & strict_majority(idx, spike, c.count) if spike.any() else spike
        pair = np.zeros_like(spike)
        single = np.zeros_like(spike)
        if few:
            pair = (c.count == 2) & np.isfinite(x)
            if pair.any():
                pair &= x > ratio * np.abs(group_min(idx, x))
            single = (c.count == 1) & np.isfinite(x)
    # own history: confirms peer spikes, alone judges peerless ranks and pairs
    hmeds = np.full_like(x, np.nan)
    for i in range(len(METRICS)):
        rows = np.flatnonzero(hit[i] | single[i] | pair[i]) if few or hit[i].any() else ()
        if len(rows) == 0:
            continue
        limit, hmed = _own_limit(state, cfg, frame.rank[rows], i)
        hmeds[i, rows] = hmed
        own = ~(x[i, rows] <= limit)  # NaN limit (no history yet) does not veto
        hit[i, rows] &= own
        pair[i, rows] &= own & np.isfinite(limit)
        s = single[i, rows] & (x[i, rows] > limit)
        if s.sum() * 2 < s.size:
            hit[i, rows] |= s
    for row in np.flatnonzero(hit.any(axis=0)):
        out.signals.append(_signal(frame, idx, c, hit, hmeds, int(row), bool(overflow[row])))
    for g in np.unique(idx.row_gid[pair.any(axis=0)]) if few else ():
        members = np.flatnonzero(idx.row_gid == g)
        row = int(members[np.argmax(np.nan_to_num(x[:, members], nan=-np.inf).max(axis=0))])
        i = int(np.argmax(np.where(pair[:, row], x[:, row], -np.inf)))
        out.signals.append(
            Signal(
                kind="sdc",
                ranks=tuple(int(r) for r in frame.rank[members]),
                detector=NAME,
                score=float(x[i, row] / c.median[i, row]),
                severity="oneshot",
                evidence=metric_evidence(
                    METRICS[i],
                    x[i, row],
                    c.median[i, row],
                    x[i, members],
                    history_median=hmeds[i, row],
                    higher_rank=int(frame.rank[row]),
                    reason="two peers disagree; no majority to attribute",
                ),
                unattributed=True,
            )
        )
    return out


def _signal(frame, idx, c, hit, hmeds, row: int, overflow: bool) -> Signal:
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(hit[:, row], c.x[:, row] / np.abs(c.median[:, row]), -np.inf)
        rel = np.where(np.isnan(rel), c.x[:, row] / hmeds[:, row], rel)
    i = 0 if overflow else int(np.argmax(np.where(np.isnan(rel), -np.inf, rel)))
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    z = c.z[i, row]
    score = float(min(z, Z_CAP)) if np.isfinite(z) or z > 0 else float(rel[i])
    score = Z_CAP if overflow else score
    # a loss outlier alone may be a hard batch; with a gradient spike it is corruption
    severity = "oneshot" if hit[0, row] else "transient"
    return Signal(
        kind="sdc",
        ranks=(int(frame.rank[row]),),
        detector=NAME,
        score=score if np.isfinite(score) else Z_CAP,
        severity=severity,
        evidence=metric_evidence(
            METRICS[i],
            np.inf if overflow else c.x[i, row],
            c.median[i, row],
            c.x[i, peers],
            history_median=hmeds[i, row],
            z=np.inf if overflow else z,
            ratio=num(rel[i]),
            spiking_metrics=[METRICS[j] for j in np.flatnonzero(hit[:, row])],
            overflow=overflow,
        ),
    )


CONFIG = MetricOutlierConfig
STATE = MetricOutlierState

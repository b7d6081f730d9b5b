"""GPU throttling: a GPU running slower than its peers (or than it used to).

Design notes: docs/detectors.md, "detectors/gpu/throttle.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.gpu.readings import (
    POWER_EVENTS,
    THERMAL_EVENTS,
    any_event,
    clock_events,
    column,
)
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.stats.consensus import peer_consensus, strict_majority
from rankscope.detectors.stats.history import RankHistory
from rankscope.detectors.stats.peers import PeerCache
from rankscope.detectors.stats.persistence import StreakCounter

__all__ = ["GpuThrottleConfig", "GpuThrottleState", "detect", "NAME"]

NAME = "gpu_throttle"
_METRICS = ("sm_clock_mhz", "power_w")
_RATIO_WINDOW = 8  # steps of compute-time ratio kept per rank for the join


@dataclass(kw_only=True, slots=True)
class GpuThrottleConfig:
    """Settings of the GPU throttle detector."""

    clock_drop_frac: float = 0.10
    """SM clock this fraction below the peer (or own history) median is a drop."""
    power_drop_frac: float = 0.25
    """Power draw this fraction below the peer median is a drop."""
    z_min: float = 3.0
    """And at least this many robust sigmas below the peer median."""
    confirm_samples: int = 3
    """Distinct GPU samples in a row that must show the drop before a signal."""
    history_samples: int = 32
    """Clean samples kept per rank for its own baseline."""
    history_min_samples: int = 8
    """Clean samples needed before the own-history comparison judges."""
    straggler_ratio: float = 1.1
    """compute_s at least this multiple of the peer median marks the rank a straggler too."""

    def __post_init__(self) -> None:
        for name in ("clock_drop_frac", "power_drop_frac"):
            v = getattr(self, name)
            if not 0 < v < 1:
                raise ValueError(f"{name} must be in (0, 1), got {v!r}")
        if self.z_min <= 0:
            raise ValueError(f"z_min must be > 0, got {self.z_min!r}")
        if self.confirm_samples < 1:
            raise ValueError(f"confirm_samples must be >= 1, got {self.confirm_samples!r}")
        if not 1 <= self.history_min_samples <= self.history_samples:
            raise ValueError("need 1 <= history_min_samples <= history_samples")
        if self.straggler_ratio < 1:
            raise ValueError(f"straggler_ratio must be >= 1, got {self.straggler_ratio!r}")


def _grown(arr: np.ndarray, top: int) -> np.ndarray:
    if arr.shape[0] >= top:
        return arr
    out = np.full(max(top, 2 * arr.shape[0]), np.nan)
    out[: arr.shape[0]] = arr
    return out


class GpuThrottleState:
    """Peer index, per-rank clean GPU history, drop streaks, and the last sample times.

    ``ratios`` / ``ratio_steps`` (recent compute-time ratios, evidence only) are not saved: after
    a restart the join simply starts from the next steps.
    """

    __slots__ = ("peers", "history", "streak", "seen_t", "learned_t", "onset", "ratios",
                 "ratio_steps")

    def __init__(self, cfg: GpuThrottleConfig | None = None) -> None:
        cfg = cfg or GpuThrottleConfig()
        self.peers = PeerCache()
        self.history = RankHistory(_METRICS, cfg.history_samples)
        self.streak = StreakCounter()
        self.seen_t = np.zeros(0)  # gpu_t last counted by the streak, per rank
        self.learned_t = np.zeros(0)  # gpu_t last learned into the history, per rank
        self.onset = np.zeros(0)  # step at which the current drop streak began, per rank
        self.ratios = np.zeros((0, _RATIO_WINDOW))  # recent compute_s / peer median, per rank
        self.ratio_steps = np.zeros((0, _RATIO_WINDOW))  # the step of each of those ratios

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        """Clean rows teach the history, once per distinct GPU sample."""
        if not frame.gpu or frame.n == 0:
            return
        ranks = frame.rank.astype(np.int64)
        self.learned_t = _grown(self.learned_t, int(ranks.max()) + 1)
        new = _new_samples(frame, self.learned_t[ranks])
        clean = np.asarray(clean_mask, dtype=bool) & new
        self.history.learn(ranks, {m: column(frame, m) for m in _METRICS}, clean)
        gt = column(frame, "gpu_t")
        self.learned_t[ranks[clean]] = gt[clean]

    def state_dict(self) -> dict:
        idx = np.flatnonzero(np.isfinite(self.onset))
        return {
            "history": self.history.state_dict(),
            "streak": self.streak.state_dict(),
            "onset": {"ranks": idx.tolist(), "steps": self.onset[idx].tolist()},
        }

    def load_state_dict(self, d: dict) -> None:
        self.history.load_state_dict(d["history"])
        self.streak.load_state_dict(d.get("streak", {}))
        onset = d.get("onset", {})
        ranks = np.asarray(onset.get("ranks", []), dtype=np.int64)
        self.onset = _grown(np.zeros(0), int(ranks.max()) + 1 if ranks.size else 0)
        self.onset[ranks] = np.asarray(onset.get("steps", []), dtype=np.float64)


def _new_samples(frame: StepFrame, last_t: np.ndarray) -> np.ndarray:
    """Rows whose GPU sample differs from ``last_t`` (every row when frames carry no time)."""
    gt = column(frame, "gpu_t")
    if not np.isfinite(gt).any():
        return np.ones(frame.n, dtype=bool)
    return np.isfinite(gt) & (gt != last_t)


def _track_compute(frame: StepFrame, idx, state: GpuThrottleState) -> np.ndarray:
    """Record this step's compute_s / peer median per rank; returns the step's ratios.

    One step's compute time is noisy; the join reports the median of the last
    few steps, so a slowdown shows whatever the single step did.
    """
    n = frame.n
    x = frame.m.get("compute_s")
    if x is None or not np.isfinite(x).any():
        return np.full(n, np.nan)
    c = peer_consensus(idx, x)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(c.median[0] > 0, x / c.median[0], np.nan)
    ranks = frame.rank.astype(np.int64)
    top = int(ranks.max()) + 1
    if state.ratios.shape[0] < top:
        size = max(top, 2 * state.ratios.shape[0])
        for name in ("ratios", "ratio_steps"):
            old = getattr(state, name)
            grown = np.full((size, _RATIO_WINDOW), np.nan)
            grown[: old.shape[0]] = old
            setattr(state, name, grown)
    slot = frame.step % _RATIO_WINDOW
    state.ratios[ranks, slot] = ratio
    state.ratio_steps[ranks, slot] = frame.step
    return ratio


def _compute_join(frame: StepFrame, state: GpuThrottleState, row: int, step_ratio: float,
                  onset: int, cfg: GpuThrottleConfig) -> dict:
    """The rank's compute time against its peers since the GPU slowed down (last few steps)."""
    x = frame.m.get("compute_s")
    if x is None or not np.isfinite(x[row]):
        return {}
    rank = int(frame.rank[row])
    if rank < state.ratios.shape[0]:
        recent = state.ratios[rank][state.ratio_steps[rank] >= min(onset, frame.step)]
    else:
        recent = np.zeros(0)
    recent = recent[np.isfinite(recent)]
    ratio = float(np.median(recent)) if recent.size else float("nan")
    return {
        "compute_s": num(x[row]),
        "compute_ratio_step": num(step_ratio),
        "compute_ratio": num(ratio),
        "compute_ratio_steps": int(recent.size),
        "straggler": bool(np.isfinite(ratio) and ratio >= cfg.straggler_ratio),
    }


def detect(frame: StepFrame, state: GpuThrottleState, cfg: GpuThrottleConfig) -> DetectorOutput:
    """A GPU whose clocks or throttle reasons set it apart from its peers (or its own past)."""
    out = DetectorOutput()
    n = frame.n
    if not frame.gpu or n == 0:
        return out
    ranks = frame.rank.astype(np.int64)
    idx = state.peers.get(frame.group)
    step_ratio = _track_compute(frame, idx, state)
    x = np.stack([column(frame, m) for m in _METRICS])
    if not np.isfinite(x).any():
        return out
    c = peer_consensus(idx, x)
    out.scores = {f"gpu_{k}": v for k, v in c.scores(_METRICS).items()}
    drop = np.array([[cfg.clock_drop_frac], [cfg.power_drop_frac]])
    with np.errstate(invalid="ignore"):
        low_peer = (c.z < -cfg.z_min) & (x < (1 - drop) * c.median)
        low_peer &= strict_majority(idx, low_peer, c.count)
        count, hmed = state.history.median(ranks, "sm_clock_mhz")
        low_self = (count >= cfg.history_min_samples) & (x[0] < (1 - cfg.clock_drop_frac) * hmed)
    events = clock_events(frame)
    thermal = any_event(events, THERMAL_EVENTS)
    power = any_event(events, POWER_EVENTS)
    self_hit = low_self & (thermal | power)
    hit = low_peer[0] | low_peer[1] | self_hit
    top = int(ranks.max()) + 1
    state.seen_t = _grown(state.seen_t, top)
    state.onset = _grown(state.onset, top)
    new = _new_samples(frame, state.seen_t[ranks])
    started = state.streak.update(ranks[new], hit[new]) == 1
    state.onset[ranks[new][started]] = frame.step
    gt = column(frame, "gpu_t")
    state.seen_t[ranks[new]] = gt[new]
    counts = state.streak.count
    streak = np.zeros(n, dtype=np.int64)
    known = ranks < counts.shape[0]
    streak[known] = counts[ranks[known]]
    for row in np.flatnonzero(hit & (streak >= cfg.confirm_samples)):
        reasons = []
        if low_peer[0, row]:
            reasons.append("clock_below_peers")
        if low_peer[1, row]:
            reasons.append("power_below_peers")
        if self_hit[row]:
            reasons.append("clock_below_own_history")
        if thermal[row]:
            reasons.append("thermal_throttle")
        if power[row]:
            reasons.append("power_throttle")
        i = 1 if (low_peer[1, row] and not low_peer[0, row]) else 0
        onset = int(state.onset[ranks[row]]) if np.isfinite(state.onset[ranks[row]]) else (
            frame.step)
        peers = idx.peers_of(int(row))
        peers = peers[peers != row]
        ref = c.median[i, row] if np.isfinite(c.median[i, row]) else hmed[row]
        score = float(1 - x[i, row] / ref) if ref and np.isfinite(ref) else 0.0
        ev = metric_evidence(
            _METRICS[i], x[i, row], c.median[i, row], x[i, peers],
            history_median=hmed[row] if i == 0 else None, z=c.z[i, row],
            reasons=reasons, clock_events=sorted(events[row] or ()),
            temp_c=num(column(frame, "temp_c")[row]), power_w=num(x[1, row]),
            sm_clock_mhz=num(x[0, row]), streak_samples=int(streak[row]),
            onset_step=onset,
            **_compute_join(frame, state, int(row), step_ratio[row], onset, cfg),
        )
        out.signals.append(Signal(kind="gpu", ranks=(int(ranks[row]),), detector=NAME,
                                  score=score, severity="persistent", evidence=ev))
    return out


CONFIG = GpuThrottleConfig
STATE = GpuThrottleState

"""The settings straggler and network share: one home for their defaults and checks.

Both judge a rank against its peers (robust z, with floors in seconds and as a
share of the step), ask the deviation to last (a streak sized by the job's
chance rate), and keep a per-rank history and windowed test of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConsensusConfig"]


@dataclass(kw_only=True, slots=True)
class ConsensusConfig:
    """Peer-consensus settings common to the straggler and network detectors (seconds)."""

    z_min: float = 3.5  # robust z above the peer median to count as deviating
    min_excess_s: float = 0.002  # and at least this many seconds above it
    min_excess_step_frac: float = 0.03  # and at least this share of the median step time
    persist_steps: int = 2  # consecutive deviating steps before a finding (in a quiet job)
    max_persist_steps: int = 6  # a noisy job asks for longer streaks, up to this
    chance_findings_per_step: float = 1e-4  # tolerated chance streaks per step, whole job
    history_steps: int = 32  # clean steps kept per rank (and for the job baseline)
    history_min_steps: int = 5  # clean steps before a history judges
    history_ratio: float = 1.25  # deviating for itself above this multiple of its median
    # windowed tests: per-step deviations standardized by the group's learnt spread,
    # averaged over windows of these lengths
    window_steps: tuple[int, ...] = (4, 8, 16, 32)
    window_clip: float = 3.0  # one step counts at most this many sigmas

    def __post_init__(self) -> None:
        if self.z_min <= 0:
            raise ValueError("z_min must be > 0")
        if self.min_excess_s < 0 or self.min_excess_step_frac < 0:
            raise ValueError("min_excess_s and min_excess_step_frac must be >= 0")
        if not 1 <= self.persist_steps <= self.max_persist_steps:
            raise ValueError("need 1 <= persist_steps <= max_persist_steps")
        if not 0 < self.chance_findings_per_step < 1:
            raise ValueError("chance_findings_per_step must be in (0, 1)")
        if not 1 <= self.history_min_steps <= self.history_steps:
            raise ValueError("need 1 <= history_min_steps <= history_steps")
        if not self.window_steps or min(self.window_steps) < 2 or max(self.window_steps) > 256:
            raise ValueError("window_steps must be lengths between 2 and 256")
        if self.window_clip <= 0:
            raise ValueError("window_clip must be > 0")

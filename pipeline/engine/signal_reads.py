"""What an incident reads from a slowness signal's evidence: slowdown, step ratio, onset.

Detectors write these in their evidence under a few names (``slowdown`` or
``ratio``; ``value`` over ``peer_median``; ``onset_step`` or ``streak_steps``);
the incident tracker (``incidents.py``) reads them here, in one place.
"""

from __future__ import annotations

from rankscope.detectors.signal import Signal
from rankscope.pipeline.engine.policy import SLOWNESS_KINDS

__all__ = ["onset_of", "slowdown_of", "step_ratio_of"]


def slowdown_of(sig: Signal) -> float | None:
    """A slowness signal's slowdown over its peers (evidence ``slowdown`` or ``ratio``)."""
    if sig.kind not in SLOWNESS_KINDS:
        return None
    ev = sig.evidence or {}
    for key in ("slowdown", "ratio"):
        v = ev.get(key)
        if isinstance(v, int | float) and v == v and v > 0:
            return float(v)
    return None


def step_ratio_of(sig: Signal) -> float | None:
    """A straggler signal's compute this step over the reference its rule compares it
    with (evidence ``value`` / ``peer_median``: the group median, or a pair's partner)."""
    if sig.kind != "straggler":
        return None
    ev = sig.evidence or {}
    v, ref = ev.get("value"), ev.get("peer_median")
    if isinstance(v, int | float) and isinstance(ref, int | float) and v == v and ref > 0:
        return float(v) / float(ref)
    return None


def onset_of(sig: Signal, step: int) -> int:
    """The step a signal says its fault began: its ``onset_step``, else its streak's
    first step, else this step (never after it)."""
    ev = sig.evidence or {}
    onset = ev.get("onset_step")
    if isinstance(onset, int | float) and onset == onset:
        return min(int(onset), step)
    streak = ev.get("streak_steps")
    if isinstance(streak, int | float) and streak == streak and streak >= 1:
        return step - int(streak) + 1
    return step

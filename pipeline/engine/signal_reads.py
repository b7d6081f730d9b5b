"""What an incident reads from a slowness signal's evidence: slowdown, step ratio,
onset, and the seconds it cost.

Detectors write these in their evidence under a few names (``slowdown`` or
``ratio``; ``value`` over ``peer_median``; ``onset_step`` or ``streak_steps``);
the incident tracker (``incidents.py``) reads them here, in one place.
"""

from __future__ import annotations

from rankscope.detectors.signal import Signal
from rankscope.pipeline.engine.policy import SLOWNESS_KINDS

__all__ = ["cost_after", "onset_of", "slowdown_of", "step_ratio_of"]


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


def cost_after(cost: float, last: int, first_step: int, sig: Signal,
               step: int) -> tuple[float, int]:  # fmt: skip
    """An incident's seconds of slowness so far and the last step counted, after signal
    ``sig`` of ``step``: what a step of it cost (``_excess_s``), for each step from the
    onset at the incident's first signal (the rule's own claim: its streak or window),
    then for each signal's own step. (0, -1): none counted yet."""
    if sig.kind not in SLOWNESS_KINDS or step <= last:
        return cost, last
    extra = _excess_s(sig)
    if extra is None:
        return cost, last
    steps = step - first_step + 1 if last < 0 else 1
    return cost + max(extra, 0.0) * max(steps, 1), step


def _excess_s(sig: Signal) -> float | None:
    """Seconds a step of ``sig`` cost: a straggler's slowdown by its rule (``slowdown``
    or ``ratio``: the run or window it judged, not only this step) times its reference
    (``peer_median``; else ``value`` - ``peer_median``), a late rank's ``awaited_s``."""
    ev = sig.evidence or {}
    if sig.kind == "straggler":
        v, ref = ev.get("value"), ev.get("peer_median")
        if not (isinstance(ref, int | float) and ref == ref):
            return None
        slow = slowdown_of(sig)
        if slow is not None:
            return (slow - 1.0) * float(ref)
        return float(v) - float(ref) if isinstance(v, int | float) and v == v else None
    awaited = ev.get("awaited_s")
    return float(awaited) if isinstance(awaited, int | float) and awaited == awaited else None

"""What a detector says about one step, before the engine merges incidents.

A detector returns ``Signal``s for the step it looked at; the engine merges
consecutive signals of the same kind on the same ranks into one finding (one
incident) and a separate policy turns ``severity`` plus duration into the
action (evict / recover / observe). Detectors classify; they never pick
actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Signal", "SEVERITIES", "DetectorOutput"]

# persistent: hardware-like, lasts (stragglers, a digest that stays wrong)
# oneshot:    a single corruption event (bit flip in a gradient, NaN origin)
# fatal:      evict at once (critical XID, uncorrected ECC growth, hang culprit)
# transient:  a deviation not (yet) confirmed; worth showing, not acting on
SEVERITIES = ("persistent", "oneshot", "fatal", "transient")


@dataclass(slots=True)
class Signal:
    """One detector's verdict on one step: these ranks show fault ``kind``."""

    kind: str  # a label kind: straggler, network, sdc, nonfinite, hang, crash, gpu
    ranks: tuple[int, ...]
    detector: str
    score: float
    severity: str = "transient"
    evidence: dict = field(default_factory=dict)
    # True when a deviation was seen but no strict healthy majority could say
    # which side is faulty (e.g. two replicas that disagree): reported, never
    # blamed on one side.
    unattributed: bool = False


@dataclass(slots=True)
class DetectorOutput:
    """Signals for the step, plus per-rank scores (metric -> array over rows) for the heatmap."""

    signals: list[Signal] = field(default_factory=list)
    scores: dict = field(default_factory=dict)

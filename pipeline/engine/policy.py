"""Severity plus duration -> action: the one place that decides evict / recover / observe.

Detectors classify (``Signal.severity``); this policy acts. Keeping it apart
means a site can make eviction more or less eager without touching any
statistics, and that the rules below are the whole story:

- ``fatal`` (critical XID, uncorrected ECC growth, a hang culprit): evict.
- ``persistent`` (hardware-like: a straggler, a replica digest that stays
  wrong): observe while young, evict once it has lasted more than
  ``evict_after_steps``. A persistent SDC (a digest that is wrong) starts at
  ``recover`` (rolling back restores the parameters) and is evicted when it
  stays wrong that long.
- ``oneshot`` (one corrupted gradient, a non-finite origin): recover (roll
  back or recompute; the hardware may be fine), unless the same host keeps
  doing it: ``recurring_sdc_incidents`` SDC incidents on one host evict it.
- ``transient`` (not confirmed): observe.
- unattributed findings (no healthy majority to blame either side): observe.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicyConfig", "decide_action", "SEVERITY_RANK"]

# Higher is worse; an incident's severity is the worst any of its signals had.
SEVERITY_RANK = {"transient": 0, "oneshot": 1, "persistent": 2, "fatal": 3}


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """When a finding becomes an eviction or a recovery."""

    evict_after_steps: int = 5
    """A persistent fault lasting MORE than this many steps evicts its host."""
    recurring_sdc_incidents: int = 2
    """This many separate SDC incidents on one host evict it (recurring corruption)."""

    def __post_init__(self) -> None:
        if self.evict_after_steps < 1:
            raise ValueError(f"evict_after_steps must be >= 1, got {self.evict_after_steps}")
        if self.recurring_sdc_incidents < 1:
            raise ValueError(
                f"recurring_sdc_incidents must be >= 1, got {self.recurring_sdc_incidents}"
            )


def decide_action(
    cfg: PolicyConfig,
    *,
    kind: str,
    severity: str,
    duration_steps: int,
    host_sdc_incidents: int = 0,
    unattributed: bool = False,
) -> str:
    """The action for an incident as it stands now.

    ``duration_steps`` counts steps from onset through the latest step seen;
    ``host_sdc_incidents`` is the largest number of SDC incidents (this one
    included) on any host this incident touches.
    """
    if severity not in SEVERITY_RANK:
        raise ValueError(f"unknown severity {severity!r}")
    if unattributed:
        return "observe"
    if severity == "fatal":
        return "evict"
    if kind == "sdc" and host_sdc_incidents >= cfg.recurring_sdc_incidents:
        return "evict"
    if severity == "persistent":
        if duration_steps > cfg.evict_after_steps:
            return "evict"
        return "recover" if kind == "sdc" else "observe"
    if severity == "oneshot":
        return "recover"
    return "observe"

"""Severity, duration and strength -> action: the one place that picks evict / recover / observe.

Detectors classify (``Signal.severity``) and measure (how much slower, how
long); this policy acts, so a site makes eviction more or less eager here
without touching any statistics. The rules (docs/detectors.md, "Actions")
are the whole story: evict only for strong, persistent, corroborated
evidence; a mild or lone signal is something to watch, never an eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicyConfig", "decide_action", "SEVERITY_RANK", "SLOWNESS_KINDS", "PAIR_RULES"]

# Higher is worse; an incident's severity is the worst any of its signals had.
SEVERITY_RANK = {"transient": 0, "oneshot": 1, "persistent": 2, "fatal": 3}
# Kinds whose evidence is a slowdown: they evict only when it is strong and corroborated.
SLOWNESS_KINDS = frozenset({"straggler", "network"})
# straggler rules that judge one of two peers by the two ranks' own histories
PAIR_RULES = frozenset({"pair", "pair_lead", "pair_gap"})


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """When a finding becomes an eviction or a recovery."""

    evict_after_steps: int = 5
    """A persistent fault lasting MORE than this many steps evicts its host."""
    pair_evict_after_steps: int = 30
    """... and MORE than this many when the only evidence is two peers' own histories
    (``PAIR_RULES``: two replicas cannot outvote each other): on a crowded host two
    replicas drift 1.3-1.6x apart for up to 20 steps (two clean dp 2 runs of 30 were
    evicted after 9 and 12 steps)."""
    recurring_sdc_incidents: int = 2
    """This many separate SDC incidents on one host evict it (recurring corruption)."""
    evict_slowdown: float = 1.25
    """A straggler or slow link evicts only when its sustained slowdown over its peers
    (the median of its signals' ratios) is at least this; below it the rank is
    ``degraded``: one ``observe`` finding, however long it lasts."""
    job_slowdown_z: float = 3.0
    """... and only when the whole job's step time since the incident began is longer
    than its quiet baseline by at least this many standard errors
    (``pipeline/engine/pace.py``): a rank that is really slow makes everyone wait; one
    that only looks slow (CPU time moved between ranks on a crowded host, other work
    between collectives) leaves the step as it was."""
    evict_current_slowdown: float = 1.1
    """... and only while it is still slow: a straggler's median compute over its
    reference in its latest steps (``current_slowdown``, up to 4) at least this. A rank
    whose window still remembers a slow spell it has left is watched, not evicted."""
    degraded_report_steps: int = 12
    """A straggler too mild to act on is reported only once this many steps have passed
    since its onset (``report_gate.py``): a crowded host's chance spells are shorter."""
    mild_report_slowdown: float = 1.3
    """A straggler whose sustained slowdown is under this (and at least
    ``evict_slowdown``) is reported only once ``mild_report_steps`` have passed."""
    mild_report_steps: int = 6
    """One step past ``evict_after_steps``: a mild spell is told when it could be acted on."""
    min_report_cost_s: float = 0.02
    """A straggler or a late rank is reported only once its slowness has cost this many
    seconds in all (its judged time over its reference, or its peers' wait for it,
    summed from its onset; ``report_gate.paid``): a host's other work takes a few
    scheduler slices (a few ms each) from one rank now and then, which on a loop of
    6 ms steps is a 2-step "straggler" of 1.5x; a 1.5x straggler of 25 ms steps has
    paid it in two steps (0: no floor)."""
    clear_sigmas: float = 6.0
    """A straggler whose sustained slowdown is this many of its group's learnt per-step
    sigmas (the detector's ``noise``) is reported at once, however mild: the waits above
    are for a crowded host's chance spells, at most 4.8 of its sigmas in 336 clean runs;
    on a quiet job a 1.17x straggler is nine (0: never)."""

    def __post_init__(self) -> None:
        if self.evict_after_steps < 1:
            raise ValueError(f"evict_after_steps must be >= 1, got {self.evict_after_steps}")
        if self.pair_evict_after_steps < self.evict_after_steps:
            raise ValueError("pair_evict_after_steps must be >= evict_after_steps")
        if self.recurring_sdc_incidents < 1:
            raise ValueError(
                f"recurring_sdc_incidents must be >= 1, got {self.recurring_sdc_incidents}"
            )
        if self.degraded_report_steps < 1:
            raise ValueError(
                f"degraded_report_steps must be >= 1, got {self.degraded_report_steps}"
            )
        if not self.min_report_cost_s >= 0:
            raise ValueError(f"min_report_cost_s must be >= 0, got {self.min_report_cost_s}")
        if not self.clear_sigmas >= 0:
            raise ValueError(f"clear_sigmas must be >= 0, got {self.clear_sigmas}")
        if self.mild_report_steps < 1:
            raise ValueError(f"mild_report_steps must be >= 1, got {self.mild_report_steps}")
        if not self.evict_slowdown > 1.0:
            raise ValueError(f"evict_slowdown must be > 1, got {self.evict_slowdown}")
        if not self.evict_current_slowdown >= 1.0:
            raise ValueError(
                f"evict_current_slowdown must be >= 1, got {self.evict_current_slowdown}"
            )
        if not self.job_slowdown_z > 0:
            raise ValueError(f"job_slowdown_z must be > 0, got {self.job_slowdown_z}")


def degraded(cfg: PolicyConfig, kind: str, slowdown: float | None) -> bool:
    """A slowness finding too mild to act on (known slowdown below ``evict_slowdown``)."""
    return kind in SLOWNESS_KINDS and slowdown is not None and slowdown < cfg.evict_slowdown


def decide_action(
    cfg: PolicyConfig,
    *,
    kind: str,
    severity: str,
    duration_steps: int,
    host_sdc_incidents: int = 0,
    unattributed: bool = False,
    slowdown: float | None = None,
    corroborated: bool = True,
    job_slowdown_z: float | None = None,
    current_slowdown: float | None = None,
    two_peers: bool = False,
) -> str:
    """The action for an incident as it stands now.

    ``duration_steps`` counts steps from onset through the latest step seen;
    ``host_sdc_incidents`` is the largest number of SDC incidents (this one
    included) on any host this incident touches; ``slowdown`` the incident's
    sustained slowdown over its peers (straggler, network; None: not
    measured); ``corroborated`` False when the only evidence is a lone signal
    that other explanations fit as well (a rank that merely waited less);
    ``job_slowdown_z`` how far (standard errors) the job's step time since
    onset exceeds its quiet baseline (None: no baseline yet, so a slowness
    finding cannot evict); ``current_slowdown`` its slowdown over its latest steps
    (None: not measured); ``two_peers`` True when only rules for two peers named it.
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
        if kind in SLOWNESS_KINDS and (
            degraded(cfg, kind, slowdown)
            or not corroborated
            or job_slowdown_z is None
            or job_slowdown_z < cfg.job_slowdown_z
            or (current_slowdown is not None and current_slowdown < cfg.evict_current_slowdown)
        ):
            return "observe"
        if duration_steps > (cfg.pair_evict_after_steps if two_peers else cfg.evict_after_steps):
            return "evict"
        return "recover" if kind == "sdc" else "observe"
    if severity == "oneshot":
        return "recover"
    return "observe"

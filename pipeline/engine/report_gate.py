"""When an incident is worth telling: the evidence a finding needs before it is reported.

Detectors confirm (severity other than ``transient``); this gate adds what one
signal cannot show. Unattributed transient slowness, a network incident of
shorter waits only and a degraded one take a second signal (one step of a
crowded host's jitter is as likely). A straggler too mild to act on
(``policy.degraded``) is reported only once it has lasted
``PolicyConfig.degraded_report_steps`` from its onset ("degraded" means
persistently a little slow), and one under ``mild_report_slowdown`` once it has
lasted ``mild_report_steps``, one step past the earliest it could evict: a
crowded host slows one rank by 1.1-1.4x for 4-9 steps every few hundred steps
(docs/false-alarms.md, thirty-fourth session). Those spells are a few of the
job's own sigmas; a slowdown ``clear_sigmas`` of them (a quiet job's mild
straggler) is told at once (thirty-fifth session). Once these have cleared it, a
straggler or a late rank is still held until it has cost the job
``min_report_cost_s`` in all (``paid``): on loops of a few ms a step, two
scheduler slices lost to the host's other work are a 2-step 1.5x lead
(thirty-ninth session).
"""

from __future__ import annotations

import math

from rankscope.pipeline.engine.policy import SLOWNESS_KINDS, PolicyConfig, degraded

__all__ = ["LONE_WAIT_RULES", "clear_of_noise", "paid", "reportable"]

# Network rules that only say "this rank waited less than the others": with no
# other rule behind them they fit unaccounted time (a rank with other work) as
# well as a slow link, so they never evict on their own.
LONE_WAIT_RULES = frozenset({"last_arrival_or_shortest_wait", "peer_comm_s"})

UNATTRIBUTED_TRANSIENT_SIGNALS = 2
"""An unattributed slowness incident of transient signals is reported from its second."""

WEAK_NETWORK_SIGNALS = 2
"""A network incident of lone-wait signals only, or a degraded one, is reported from
its second signal."""


def reportable(inc, policy: PolicyConfig, step: int, sustained: float | None,
               report_transient: bool = False) -> bool:  # fmt: skip
    """Whether incident ``inc`` (not yet reported) is a finding as of ``step``;
    ``sustained``: its sustained slowdown so far (None: not measured)."""
    # unattributed (reported, never blamed): at once, but transient slowness takes a
    # second signal (one step of a clean 2-core host's jitter left 3 of 42 clean bench
    # runs with a one-step "no one to blame" network finding, bench_false_alarms)
    ok = (
        inc.severity != "transient"
        or (inc.unattributed and (inc.kind not in SLOWNESS_KINDS
                                  or inc.signals >= UNATTRIBUTED_TRANSIENT_SIGNALS))
        or report_transient
    )  # fmt: skip
    # a shorter wait alone is the weakest evidence there is, and a degraded late arrival
    # the next: one step of either is a crowded host's jitter as often as a link
    # (docs/detectors.md, "Actions")
    if inc.kind == "network" and (
        (inc.rules and inc.rules <= LONE_WAIT_RULES)
        or (not inc.unattributed and not report_transient
            and degraded(policy, inc.kind, sustained))
    ):  # fmt: skip
        ok = ok and inc.signals >= WEAK_NETWORK_SIGNALS
    if (ok and inc.kind == "straggler" and not inc.unattributed and not report_transient
            and sustained is not None):  # fmt: skip
        lasted = step - inc.first_step + 1
        if clear_of_noise(policy, sustained, inc.noise):
            return True  # no chance spell of a job this quiet: nothing to wait for
        if degraded(policy, inc.kind, sustained):
            ok = lasted >= policy.degraded_report_steps
        elif sustained < policy.mild_report_slowdown:
            ok = lasted >= policy.mild_report_steps
    return ok


def clear_of_noise(policy: PolicyConfig, sustained: float | None, noise: float | None) -> bool:
    """A sustained slowdown ``policy.clear_sigmas`` of the group's learnt per-step sigma
    (``noise``, of the log ratio) or more: no chance spell of this job's, however mild."""
    if not policy.clear_sigmas or sustained is None or noise is None or not noise > 0:
        return False
    return math.log(max(sustained, 1.0)) >= policy.clear_sigmas * noise


def paid(inc, policy: PolicyConfig, report_transient: bool = False) -> bool:
    """Whether incident ``inc``, which ``reportable`` has cleared, has cost the job
    ``policy.min_report_cost_s`` (its ``cost_s``; not measured: yes). Until then it is
    held, cleared: the verdict stands while its later, milder signals come in."""
    if inc.unattributed or report_transient or inc.cost_step < 0:
        return True
    return inc.cost_s >= policy.min_report_cost_s

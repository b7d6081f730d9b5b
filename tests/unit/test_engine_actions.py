"""Actions that match the evidence: strong, corroborated, accounted-for slowness evicts;
mild slowness is one degraded observe finding; a lone shorter wait never evicts; an
evict on a job's only host names the ranks."""

from __future__ import annotations

from rankscope.detectors.signal import Signal
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.engine.incidents import IncidentTracker
from rankscope.pipeline.engine.policy import PolicyConfig
from rankscope.pipeline.serve.control import control_message
from support.engine_synth import make_records


def _slow(rank=3, kind="straggler", ratio=1.5, rule="step_expected", streak=2):
    ev = {"ratio": ratio, "rule": rule, "streak_steps": streak}
    if kind == "network":
        ev = {"slowdown": ratio, "rule": rule, "streak_steps": streak}
    return Signal(kind=kind, ranks=(rank,), detector=kind, score=5.0, severity="persistent",
                  evidence=ev)  # fmt: skip


def _hosts(ranks):
    return [f"h{r // 4}" for r in ranks]


def _feed(tr, steps, sig_at, step_s_at, make_sig):
    for s in range(steps):
        tr.update(s, float(s), [make_sig()] if sig_at(s) else [], _hosts, step_s=step_s_at(s))
    return sorted(tr.findings.values(), key=lambda f: f.first_step)


def test_a_persistently_mild_rank_is_one_degraded_observe_finding():
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    # 1.15x, seen in bursts with long quiet gaps between them, for 400 steps
    fs = _feed(tr, 400, lambda s: s >= 20 and s % 40 < 10, lambda s: 1.0 + 0.01 * (s % 3),
               lambda: _slow(ratio=1.15))  # fmt: skip
    (f,) = fs
    assert f.action == "observe" and f.evidence["degraded"] is True
    assert f.first_step == 39 and f.last_step == 369  # onset of the first burst (streak 2)


def test_a_chance_mild_episode_long_before_a_fault_is_not_its_onset():
    """bench f600, fault-straggler1.25-amp-0016: rank 2 read 1.07-1.19x for 3 steps at
    step 145 by chance, then a 1.25x fault from step 300 read 1.1-1.2x: the fault's
    finding starts at its own onset. The chance episode, shorter than
    ``degraded_report_steps``, is no finding at all; with the gate off it is its own."""
    fs = _feed(IncidentTracker("j", PolicyConfig(), merge_gap_steps=2), 400,
               lambda s: 145 <= s < 148 or s >= 310, lambda s: 1.0 + 0.01 * (s % 3),
               lambda: _slow(rank=2, ratio=1.15))  # fmt: skip
    (fault,) = fs
    assert fault.first_step == 309 and fault.last_step == 399
    assert fault.detected_step == 309 + 12 - 1  # reported once it has lasted
    assert fault.evidence["degraded"] is True and fault.action == "observe"
    tr = IncidentTracker("j", PolicyConfig(degraded_report_steps=1), merge_gap_steps=2)
    chance, fault = _feed(tr, 400, lambda s: 145 <= s < 148 or s >= 310,
                          lambda s: 1.0 + 0.01 * (s % 3), lambda: _slow(rank=2, ratio=1.15))
    assert chance.first_step == 144 and chance.last_step == 147
    assert fault.first_step == 309 and fault.detected_step == 310


def test_a_mild_spell_must_last_but_a_strong_one_is_told_at_once():
    """The report gate (``report_gate.py``): a 1.15x spell of 8 steps, a crowded host's
    chance, is no finding; one of 30 is, from its onset, once 12 steps have passed; a
    1.28x one once 6 have (it could evict no sooner); a 1.5x slowdown is reported on
    its first confirmed step."""
    def first(ratio, steps):
        tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
        fs = _feed(tr, 100, lambda s: 40 <= s < 40 + steps, lambda s: 1.0 + 0.01 * (s % 3),
                   lambda: _slow(ratio=ratio))  # fmt: skip
        return [(f.first_step, f.detected_step) for f in fs]

    assert first(1.15, 8) == []
    assert first(1.15, 30) == [(39, 50)]
    assert first(1.28, 4) == []
    assert first(1.28, 10) == [(39, 44)]
    assert first(1.5, 2) == [(39, 40)]


def test_a_mild_late_arrival_of_one_step_is_no_finding():
    """cl600e nanogpt_master (thirty-fourth session): one step of a rank arriving last,
    1.4 ms awaited, slowdown 1.03x: a finding. A degraded network incident now takes a
    second signal; a strong one is still reported on its first."""
    def first(ratio, steps):
        tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
        fs = _feed(tr, 60, lambda s: 40 <= s < 40 + steps, lambda s: 1.0 + 0.01 * (s % 3),
                   lambda: _slow(kind="network", ratio=ratio, rule="persistent_last_arrival",
                                 streak=1))  # fmt: skip
        return [(f.first_step, f.detected_step) for f in fs]

    assert first(1.03, 1) == []
    assert first(1.03, 3) == [(40, 41)]
    assert first(1.5, 1) == [(40, 40)]


def test_a_strong_slowdown_the_job_pays_for_evicts_once_persistent():
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    fs = _feed(tr, 60, lambda s: s >= 30, lambda s: (1.0 if s < 29 else 1.4) + 0.01 * (s % 3),
               lambda: _slow(ratio=1.5))  # fmt: skip
    (f,) = fs
    assert f.action == "evict" and f.first_step == 29
    assert f.evidence["job_slowdown"] > 1.3 and f.evidence["job_slowdown_z"] > 3


def test_slowness_the_job_does_not_pay_for_is_observed():
    """A rank that looks 1.5x slow while the job's step stays as it was (the host moved
    CPU time between ranks): the time is not accounted for, no eviction."""
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    fs = _feed(tr, 80, lambda s: s >= 30, lambda s: 1.0 + 0.01 * (s % 3),
               lambda: _slow(ratio=1.5))  # fmt: skip
    (f,) = fs
    assert f.action == "observe" and "degraded" not in f.evidence


def test_a_lone_shorter_wait_never_evicts_but_a_corroborated_late_arrival_does():
    lone = IncidentTracker("j", PolicyConfig())
    (f,) = _feed(lone, 80, lambda s: s >= 30, lambda s: 1.0 if s < 29 else 1.5,
                 lambda: _slow(kind="network", rule="peer_comm_s"))  # fmt: skip
    assert f.action == "observe" and "uncorroborated" in f.evidence
    late = IncidentTracker("j", PolicyConfig())
    (g,) = _feed(late, 80, lambda s: s >= 30, lambda s: (1.0 if s < 29 else 1.5) + 0.01 * (s % 2),
                 lambda: _slow(kind="network", rule="late_arrival_window"))  # fmt: skip
    assert g.action == "evict"


def _one_finding(dp: int, slow_rank: int):
    """The single finding of a strict engine over a 1.6x straggler from step 10."""
    recs = make_records(steps=40, dp=dp, tp=1, ranks_per_host=4, straggler=(slow_rank, 10, 1.6))
    engine = Engine(EngineConfig(strict=True))
    engine.feed(sorted(recs, key=lambda r: r["t"]))
    engine.flush()
    (f,) = engine.findings()
    return f


def test_an_evict_on_the_only_host_names_the_ranks_not_the_host():
    f = _one_finding(4, 2)
    assert (f.kind, f.ranks, f.hosts, f.action) == ("straggler", [2], ["h0"], "evict")
    assert f.evidence["evict_scope"] == "ranks" and "h0" in f.evidence["host_note"]
    msg = control_message(f, now=1.0)
    assert msg["ranks"] == [2] and msg["hosts"] == []
    assert "stops the job" in msg["reason"]


def test_an_evict_on_one_of_several_hosts_names_the_host():
    f = _one_finding(8, 5)
    assert (f.hosts, f.action) == (["h1"], "evict") and "evict_scope" not in f.evidence
    assert control_message(f, now=1.0)["hosts"] == ["h1"]


def test_degraded_incidents_and_the_pace_survive_a_restart():
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    _feed(tr, 60, lambda s: 20 <= s < 30, lambda s: 1.0, lambda: _slow(ratio=1.15))
    saved = tr.state_dict()
    tr2 = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    tr2.load_state_dict(saved)
    (f,) = tr2.update(70, 70.0, [_slow(ratio=1.12)], _hosts, step_s=1.0)
    assert f.first_step == 19 and f.last_step == 70 and f.action == "observe"
    assert len(tr2.pace.quiet) == len(tr.pace.quiet)


def test_a_straggler_beside_an_open_slow_link_on_another_rank_is_contested():
    """bench_false_alarms, fault-network0.02-nanogpt: a slow link on rank 2, and healthy
    rank 0's compute rose beside it; the job's slowdown backs either, so neither evicts."""
    step_s = lambda s: (1.0 if s < 29 else 1.4) + 0.01 * (s % 3)  # noqa: E731
    both = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    for s in range(60):
        sigs = [_slow(rank=0, ratio=1.5)] if s >= 30 else []
        if s >= 32:
            sigs.append(_slow(rank=2, kind="network", ratio=1.5, rule="late_arrival_window"))
        both.update(s, float(s), sigs, _hosts, step_s=step_s(s))
    found = {f.kind: f for f in both.findings.values()}
    assert {f.action for f in found.values()} == {"observe"}
    assert "network" in found["straggler"].evidence["contested"]
    assert "straggler" in found["network"].evidence["contested"]
    alone = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    (f,) = _feed(alone, 60, lambda s: s >= 30, step_s, lambda: _slow(rank=0, ratio=1.5))
    assert f.action == "evict" and "contested" not in f.evidence  # the same, uncontested


def _bursts(steps, mild, strong):
    """Findings of a rank read 1.15x on the steps of ``mild`` and 1.4x on ``strong``."""
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    for s in range(steps):
        sig = [_slow(ratio=1.15)] if s in mild else [_slow(ratio=1.4)] if s in strong else []
        tr.update(s, float(s), sig, _hosts, step_s=1.0 + 0.01 * (s % 3))
    return sorted(tr.findings.values(), key=lambda f: f.first_step)


def test_a_mild_incident_that_turns_strong_within_the_reopen_gap_is_one_finding():
    """A 1.25x straggler read 1.15x for a while, went quiet for a few steps, then read
    1.4x (bench_false_alarms, 80-step nanogpt and tp runs): one incident, not two. A
    strong slowdown long after the mild one ended is a new finding."""
    (f,) = _bursts(80, range(20, 40), range(44, 60))
    assert (f.first_step, f.last_step) == (19, 59)
    fs = _bursts(120, range(20, 40), range(80, 100))
    assert [(g.first_step, g.last_step) for g in fs] == [(19, 39), (79, 99)]


def _held(rank, ratio, now, partner=0.05):
    """A straggler signal whose run ratio is ``ratio`` and whose step reads ``now`` x
    its partner (evidence value / peer_median, as pair_gap writes it)."""
    sig = _slow(rank=rank, ratio=ratio, rule="pair_gap")
    sig.evidence.update(value=partner * now, peer_median=partner)
    return sig


def test_a_rank_its_window_still_holds_after_its_slow_spell_is_not_evicted():
    """ppf80 fault-straggler1.5-pp-0006: a pp replica 1.3x its sped-up partner for a
    few steps, then back at 0.9-1.1x while its 16-step window kept it named at 1.4x;
    the job slowed from a real straggler elsewhere, and it was evicted."""
    step_s = lambda s: (1.0 if s < 29 else 1.4) + 0.01 * (s % 3)  # noqa: E731
    for now, action in ((1.0, "observe"), (1.05, "observe"), (1.4, "evict")):
        tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
        (f,) = _feed(tr, 60, lambda s: s >= 30, step_s, lambda n=now: _held(3, 1.45, n))
        assert f.action == action, now
        assert f.evidence["current_slowdown"] == now
    # a slowdown no rule measured per step (no value / peer_median) is not held back
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    (f,) = _feed(tr, 60, lambda s: s >= 30, step_s, lambda: _slow(ratio=1.5))
    assert f.action == "evict" and "current_slowdown" not in f.evidence


def test_the_weaker_of_two_stragglers_does_not_evict_on_the_stronger_ones_slowdown():
    step_s = lambda s: (1.0 if s < 29 else 1.4) + 0.01 * (s % 3)  # noqa: E731
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    for s in range(60):
        sigs = [_held(1, 1.6, 1.6)] if s >= 30 else []
        if s >= 26:
            sigs.append(_held(3, 1.3, 1.3))
        tr.update(s, float(s), sigs, _hosts, step_s=step_s(s))
    found = {f.ranks[0]: f for f in tr.findings.values()}
    assert found[1].action == "evict" and "contested" not in found[1].evidence
    assert found[3].action == "observe" and "[1]" in found[3].evidence["contested"]
    assert "evict" not in found[3].evidence.get("actions", {})


def test_a_mild_straggler_beside_a_reported_slow_link_is_held_until_the_link_ends():
    """bench vl600 and f600 slow-link runs: while the link on rank 2 was named, healthy
    ranks read 1.1-1.2x (the link's late returns land in what their collectors count
    as compute). A mild straggler is not reported while such a link is; one that
    outlasts the link is, from its own onset; a strong one is at once (contested)."""
    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    for s in range(120):
        sigs = []
        if 20 <= s < 70:
            sigs.append(_slow(rank=2, kind="network", ratio=1.3, rule="late_arrival_window"))
        if 30 <= s < 45:
            sigs.append(_slow(rank=0, ratio=1.15))  # held, never reported
        if s >= 50:
            sigs.append(_slow(rank=1, ratio=1.15))  # outlasts the link
        if 55 <= s < 65:
            sigs.append(_slow(rank=3, ratio=1.6))  # strong: reported at once
        tr.update(s, float(s), sigs, _hosts, step_s=1.0 + 0.01 * (s % 3))
    got = sorted((f.kind, f.ranks, f.first_step, f.detected_step) for f in tr.findings.values())
    assert got == [("network", [2], 19, 20), ("straggler", [1], 49, 73),
                   ("straggler", [3], 54, 55)]  # fmt: skip


def test_a_named_stragglers_shorter_waits_are_not_a_second_finding():
    """bench f600 tp and tutorial straggler runs: the straggler, arriving last, waited
    least for a couple of steps now and then, and each time a 2-step network observe
    named it beside its own straggler finding. Shorter waits alone on a rank an open
    straggler incident names are that incident's; on another rank, or with a rule
    that sees the link itself, they are still reported."""
    def lone(rank):
        return _slow(rank=rank, kind="network", ratio=1.2, rule="last_arrival_or_shortest_wait")

    tr = IncidentTracker("j", PolicyConfig(), merge_gap_steps=2)
    for s in range(80):
        sigs = [_slow(rank=2, ratio=1.5)] if s >= 20 else []
        if s in (40, 41):
            sigs.append(lone(2))  # the straggler's own: held
        if s in (50, 51):
            sigs.append(lone(1))  # another rank's: reported from its second
        if s in (60, 61):
            sigs += [lone(3), _slow(rank=3, kind="network", ratio=1.2, rule="late_return_window")]
        tr.update(s, float(s), sigs, _hosts, step_s=1.0 + 0.01 * (s % 3))
    got = sorted((f.kind, f.ranks, f.first_step) for f in tr.findings.values())
    assert got == [("network", [1], 49), ("network", [3], 59), ("straggler", [2], 19)], got


def test_two_peers_own_histories_evict_only_a_slowdown_that_outlasts_a_drift():
    """w2 clean-nanogpt-0015 / -0011 (two gloo replicas on a crowded host): one
    replica 1.5x the other for 9-12 steps, named by the pair rules, was evicted.
    Two peers cannot outvote each other: their rules evict only after
    ``pair_evict_after_steps``; a rule with a peer majority after ``evict_after_steps``."""
    step_s = lambda s: (1.0 if s < 29 else 1.4) + 0.01 * (s % 3)  # noqa: E731
    cfg = PolicyConfig()
    for rule, last, action in (("pair", 50, "observe"), ("pair_lead", 50, "observe"),
                               ("pair", 80, "evict"), ("window", 50, "evict")):  # fmt: skip
        tr = IncidentTracker("j", cfg, merge_gap_steps=2)
        (f,) = _feed(tr, last, lambda s: s >= 30, step_s, lambda r=rule: _slow(rule=r))
        assert f.action == action, (rule, last)
        if action == "evict":
            lasted = f.evidence["actions"]["evict"]["step"] - f.first_step + 1
            assert lasted == (cfg.evict_after_steps if rule == "window"
                              else cfg.pair_evict_after_steps) + 1  # fmt: skip

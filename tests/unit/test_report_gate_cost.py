"""A straggler is told once its slowness has cost the job ``min_report_cost_s``.

On a loop of 6 ms steps a host that lends one rank's core to other work for a
couple of scheduler slices makes a 2-step lead of 1.5x (3 of 10 clean dp 2 runs
of the bench's ``manual`` loop): a few ms in all. The same ratio on 25 ms steps
has cost 25 ms by its second step and is told at once; a real straggler of a
fast loop is told once it has paid the floor, with its onset kept.
"""

from __future__ import annotations

from rankscope.detectors.signal import Signal
from rankscope.pipeline.engine.incidents import IncidentTracker
from rankscope.pipeline.engine.policy import PolicyConfig


def _lead(value: float, ref: float, streak: int) -> Signal:
    return Signal(kind="straggler", ranks=(1,), detector="straggler", score=value / ref,
                  severity="persistent",
                  evidence={"metric": "compute_s", "value": value, "peer_median": ref,
                            "ratio": value / ref, "rule": "pair_lead",
                            "streak_steps": streak})  # fmt: skip


def _told(steps: dict[int, Signal], policy=None, until: int = 80):
    tr = IncidentTracker("j", policy or PolicyConfig(), merge_gap_steps=2)
    for step in range(until):
        sig = steps.get(step)
        tr.update(step, float(step), [sig] if sig else [], lambda rs: ["h0"] * len(rs))
    return [(f.ranks, f.first_step, f.detected_step) for f in tr.findings.values()]


def test_a_two_step_lead_of_a_few_ms_is_not_told():
    assert _told({41: _lead(0.0115, 0.0058, 2)}) == []
    assert _told({41: _lead(0.0115, 0.0058, 2)}, PolicyConfig(min_report_cost_s=0)) == [
        ([1], 40, 41)]


def test_the_same_ratio_on_longer_steps_is_told_on_its_first_signal():
    assert _told({41: _lead(0.05, 0.025, 2)}) == [([1], 40, 41)]


def test_a_fast_loops_straggler_is_told_once_it_has_paid_the_floor():
    """3 ms a step over 6 ms: 6 ms at its 2-step confirmation, 20 ms five steps later."""
    steps = {s: _lead(0.009, 0.006, 2 + s - 41) for s in range(41, 70)}
    (found,) = _told(steps)
    assert found[:2] == ([1], 40)
    assert found[2] == 46  # 6 ms at 41, then 3 ms a step: 21 ms at 46

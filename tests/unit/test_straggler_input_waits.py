"""Input waits (``data_s``) are judged by what they cost the step, not by their ratio.

A loader's wait is a millisecond or so, so a few milliseconds more is a sixfold
"slowdown" over the peers and a hundred robust sigmas: on a loaded host that is
a scheduling hiccup. A rank is slow on input only when the excess is
``min_ratio - 1`` of the step (straggler/detector.py, ``_floors``), and only
where its peers waited that excess out in the step's collectives
(straggler/input_wait.py): a wait the step absorbed cost the job nothing.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame
from support.synth import run_detector as run


def frames_with_input(extra_s: float, rank: int = 5, onset: int = 15, steps: int = 40,
                      waited: bool = True):  # fmt: skip
    """8 ranks, ~0.26 s steps; from ``onset`` ``rank`` waits ``extra_s`` more for input,
    and (``waited``) its peers wait that long for it in the gradient all-reduce."""
    rng = np.random.default_rng(7)
    lay = layout(8)
    out = []
    for step in range(steps):
        data = 0.001 + 0.0002 * rng.random(8)
        comm = 0.05 + 0.01 * rng.random(8)
        if step >= onset:
            data[rank] += extra_s
            if waited:
                comm[np.arange(8) != rank] += extra_s
        m = {"compute_s": 0.2 * (1 + 0.02 * rng.standard_normal(8)), "data_s": data,
             "comm_s": comm}  # fmt: skip
        m["step_s"] = m["compute_s"] + m["data_s"] + m["comm_s"]
        out.append(make_frame(lay, step, m))
    return out


def named(outs):
    return {r for o in outs for s in o.signals if not s.unattributed for r in s.ranks}


def test_a_few_milliseconds_more_input_wait_is_not_a_straggler():
    outs, _ = run(S, frames_with_input(0.015))  # 6 % of the step, 13x its peers' wait
    assert named(outs) == set()


def test_an_input_stall_that_costs_the_step_is_found_on_data_s():
    outs, _ = run(S, frames_with_input(0.06))  # 23 % of the step
    assert named(outs) == {5}
    sig = next(s for o in outs for s in o.signals)
    assert sig.evidence["metric"] == "data_s" and sig.severity == "persistent"


def test_the_share_rule_is_per_metric_and_can_be_turned_off():
    cfg = S.StragglerConfig(step_share_metrics=())
    outs, _ = run(S, frames_with_input(0.015), cfg=cfg)
    assert named(outs) == {5}  # judged by the millisecond floors alone, as before


def test_an_input_stall_the_step_absorbed_is_not_a_straggler():
    # the same 23 % stall, but no peer waited for it (a short batch, an early arrival)
    outs, _ = run(S, frames_with_input(0.06, waited=False))
    assert named(outs) == set()
    cfg = S.StragglerConfig(input_wait_frac=0.0)  # the rule off: named as before
    outs, _ = run(S, frames_with_input(0.06, waited=False), cfg=cfg)
    assert named(outs) == {5}


def test_without_comm_times_nothing_is_asked_of_the_peers():
    frames = frames_with_input(0.06, waited=False)
    for f in frames:
        f.m["comm_s"] = np.full(f.n, np.nan)
    outs, _ = run(S, frames)
    assert named(outs) == {5}

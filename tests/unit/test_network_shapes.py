"""Network shapes the first rules missed (issue #14), on hand-built frames.

1. A link slow INSIDE its collectives, cascading: rank 2's link is slow, so
   both of its groups (dp {0,2,4,6}, tp {2,3}) take long with nobody late in
   them; the dp members then arrive late to their own tp pairs, so every
   other tp group shows a late arriver who only waited elsewhere.
2. Unaccounted time: a rank with 25% less communication than its peers, the
   same compute and the same step time, and no arrival times to say it came
   late: other work, not a fault.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.network import detector as network
from support.synth import layout, make_frame
from support.synth import run_detector as run


def _blamed(outs):
    return {r for o in outs for s in o.signals if not s.unattributed for r in s.ranks}


def _slow_link_frames(steps=16, fault_from=8, slow=2, delay=0.08, seed=3):
    lay = layout(4, 2, 1)  # tp fastest: tp pairs {0,1} {2,3} {4,5} {6,7}; dp {0,2,4,6} {1,3,5,7}
    w = 8
    rng = np.random.default_rng(seed)
    frames = []
    for step in range(steps):
        t = 1.7e9 + step
        fault = step >= fault_from
        colls = [[] for _ in range(w)]
        enter = t + 0.1 + 0.0005 * rng.random(w)
        done_dp = np.zeros(w)
        for tp_i in range(2):  # dp all-reduce per tp index, everyone on time
            members = [r for r in range(w) if r % 2 == tp_i]
            dur = 0.02 + (delay if fault and slow in members else 0.0)
            finish = enter[members].max() + dur
            for r in members:
                colls[r].append({"op": "allreduce", "group": "dp", "seq": step,
                                 "t0": float(enter[r]), "s": float(finish - enter[r])})
                done_dp[r] = finish
        for pair in range(4):  # then the tp all-reduce of each pair
            members = [2 * pair, 2 * pair + 1]
            arrive = done_dp[members] + 0.001 + 0.0002 * rng.random(2)
            dur = 0.01 + (delay if fault and slow in members else 0.0)
            finish = arrive.max() + dur
            for r, a in zip(members, arrive, strict=True):
                colls[r].append({"op": "allreduce", "group": "tp", "seq": step,
                                 "t0": float(a), "s": float(finish - a)})
        comm = np.array([sum(c["s"] for c in cs) for cs in colls])
        compute = np.full(w, 0.1) * (1 + 0.01 * rng.standard_normal(w))
        m = {"compute_s": compute, "comm_s": comm, "data_s": np.zeros(w),
             "step_s": compute + comm}
        frames.append(make_frame(lay, step, m, collectives=colls))
    return frames


def test_link_slow_inside_its_collectives_is_found_through_the_cascade():
    outs, _ = run(network, _slow_link_frames())
    assert _blamed(outs) == {2}
    rules = {s.evidence["rule"] for o in outs for s in o.signals}
    assert rules == {"cross_group_intersection"}
    first = min(i for i, o in enumerate(outs) if o.signals)
    assert 8 <= first <= 10


def test_the_same_job_without_the_slow_link_is_quiet():
    outs, _ = run(network, _slow_link_frames(fault_from=10_000))
    assert _blamed(outs) == set()


def _pipeline_frames(steps=20, odd=5, seed=4):
    """dp=4 x pp=2 without per-collective timings: rank ``odd`` spends 25% less in
    communication than its dp peers, its compute and step as theirs (the rest of
    its step is time the trace does not account for)."""
    lay = layout(4, 1, 2)
    w = 8
    rng = np.random.default_rng(seed)
    frames = []
    for step in range(steps):
        compute = 0.2 * (1 + 0.01 * rng.standard_normal(w))
        comm = 0.2 * (1 + 0.01 * rng.standard_normal(w))
        step_s = np.full(w, 0.42)
        if step >= 5:
            comm[odd] *= 0.75
        frames.append(make_frame(lay, step, {"compute_s": compute, "comm_s": comm,
                                             "data_s": np.full(w, 0.01), "step_s": step_s}))
    return frames


def test_less_waiting_with_no_more_compute_and_no_longer_step_is_not_a_fault():
    outs, _ = run(network, _pipeline_frames())
    assert _blamed(outs) == set()


def test_less_waiting_that_made_the_others_wait_is_still_found():
    """The same rank waiting less, but its peers' steps grew by what they waited for
    it and nothing of its own step is unaccounted: it was awaited (rule peer_comm_s)."""
    frames = _pipeline_frames()
    for f in frames[5:]:
        others = np.arange(8) != 5
        f.m["comm_s"][others] += 0.05
        f.m["comm_s"][5] += 0.05  # back to its peers' old level: 0.05 less than them now
        f.m["step_s"][:] = 0.2 + f.m["comm_s"] + 0.01
    outs, _ = run(network, frames)
    assert _blamed(outs) == {5}

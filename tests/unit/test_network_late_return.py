"""Late returns (rule ``late_return_window``) and how collectives are keyed, on built frames.

A rank whose collective calls return well after every other member's has spent
that time on its own side: a slow completion, or a slow delivery to it. The
job's model is FSDP2 under tensor parallelism (dp 2 x tp 2): every group has
two members, so nobody is late in a way a majority could vote on, but a late
return is one-sided. The host is noisy: arrival jitter, return jitter, and
now and then a rank descheduled for 12 ms on its way out of a call.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.network import detector as network
from rankscope.detectors.network.waits import collective_waits
from support.synth import layout, make_frame
from support.synth import run_detector as run

DELAY = 0.02  # the slow rank's first reduce-scatter of a step returns this late


def _tp_job(steps=64, fault_from=36, slow=2, seed=0, slow_compute=None, skew=None,
            delay=DELAY, fault_until=None):  # fmt: skip
    """Frames of a dp 2 x tp 2 step: dp reduce-scatter and tp all-reduce, alternating.

    A rank enters each call 1 ms (plus jitter) after it left the previous one;
    a call completes when its last member is in; each member returns from it
    after a jitter of its own. ``slow`` returns DELAY late from its first
    reduce-scatter of each step from ``fault_from`` on; ``slow_compute`` is a
    rank that computes 40 ms more before its first call from step 10 on (a
    straggler: it arrives late and its partners wait, but it returns on time);
    ``skew`` a rank whose clock runs 15 ms ahead; ``delay`` and ``fault_until``
    another lateness and its last step.
    """
    lay = layout(2, 2)  # tp pairs {0,1} {2,3}; dp pairs {0,2} {1,3}
    w = 4
    rng = np.random.default_rng(seed)
    groups = [("dp", [[0, 2], [1, 3]]), ("tp", [[0, 1], [2, 3]])]
    frames = []
    for step in range(steps):
        colls = [[] for _ in range(w)]
        free = np.full(w, 1.7e9 + step * 0.3)  # when each rank left its previous call
        first_rs = True
        for k in range(6):
            name, sets = groups[k % 2]
            gap = 0.001 + rng.exponential(0.004, w) + 0.01
            if slow_compute is not None and k == 0 and step >= 10:
                gap[slow_compute] += 0.04  # its forward, before the step's first call
            enter = free + gap
            for members in sets:
                done = enter[members].max() + 0.005
                for r in members:
                    out = done + rng.exponential(0.0015)
                    if rng.random() < 0.02:
                        out += 0.012  # descheduled on its way out
                    if (name == "dp" and first_rs and r == slow and step >= fault_from
                            and (fault_until is None or step <= fault_until)):
                        out += delay
                    t0 = enter[r] + (0.015 if r == skew else 0.0)
                    colls[r].append({"op": "reduce_scatter" if name == "dp" else "allreduce",
                                     "group": name, "seq": step * 3 + k // 2,
                                     "t0": float(t0), "s": float(out - enter[r])})
                    free[r] = out
            first_rs = first_rs and name != "dp"
        comm = np.array([sum(c["s"] for c in cs) for cs in colls])
        compute = 0.1 * (1 + 0.02 * rng.standard_normal(w))
        if slow_compute is not None and step >= 10:
            compute[slow_compute] += 0.04
        m = {"compute_s": compute, "comm_s": comm, "data_s": np.full(w, 0.001),
             "step_s": compute + comm + 0.001}
        frames.append(make_frame(lay, step, m, collectives=colls))
    return frames


def _named(outs):
    return [(i, s) for i, o in enumerate(outs) for s in o.signals if not s.unattributed]


def test_a_late_return_in_two_member_groups_names_the_rank_and_holds():
    for seed in range(3):
        outs, _ = run(network, _tp_job(seed=seed))
        got = _named(outs)
        assert {r for _, s in got for r in s.ranks} == {2}, seed
        late = [i for i, s in got if s.evidence["rule"] == "late_return_window"]
        assert 38 <= late[0] <= 50, (seed, late)  # a few steps of window, then the streak
        # one run of signals to the end: the window holds what it named
        assert sorted({i for i, _ in got if i >= late[0]}) == list(range(late[0], 64)), seed
        assert all(0.01 < s.evidence["awaited_s"] for _, s in got)


def test_a_slow_link_early_in_the_job_is_not_learnt_as_the_ranks_habit():
    # from step 12 the usual late return is still filling (32 clean steps): the slow
    # returns must not become the rank's usual, or the window loses what it measures
    for seed in range(3):
        outs, state = run(network, _tp_job(fault_from=12, seed=seed))
        got = _named(outs)
        assert {r for _, s in got for r in s.ranks} == {2}, seed
        late = [i for i, s in got if s.evidence["rule"] == "late_return_window"]
        assert late and late[0] <= 30, (seed, late)
        assert sorted({i for i, _ in got if i >= late[0]}) == list(range(late[0], 64)), seed
        _, usual = state.held.median(np.array([2]), "held")
        assert usual[0] < DELAY / 2, (seed, usual)


def test_no_late_return_rule_fires_on_a_noisy_healthy_job():
    for seed in range(6):
        outs, _ = run(network, _tp_job(fault_from=10_000, seed=seed))
        assert _named(outs) == [], seed


def test_a_straggler_or_a_clock_ahead_is_not_a_network_fault():
    # the straggler's own compute, against all four ranks doing the same work (its
    # dp partner alone is half itself in a median), explains why its partners wait
    outs, _ = run(network, _tp_job(fault_from=10_000, slow_compute=1))
    assert _named(outs) == []
    outs, _ = run(network, _tp_job(fault_from=10_000, skew=3))  # learnt as its clock
    assert _named(outs) == []
    outs, _ = run(network, _tp_job(skew=3))  # and the slow rank is still found beside it
    assert {r for _, s in _named(outs) for r in s.ranks} == {2}


def _pp_frame(stage1_late=0.0, send_late=0.0):
    """pp 2 x dp 2: both stages' replica all-reduce are named ``dp_replicate`` with
    the same seq (the collector names groups by mesh dimension), at different times;
    stage 0 sends to stage 1 before."""
    lay = layout(2, 1, 2)  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    t = 1.7e9
    colls = [[] for _ in range(4)]
    for d in range(2):  # rank d sends to rank d + 2; rank 2's sender is late
        send = t + 0.01 + (send_late if d == 0 else 0.0)
        done = max(send, t + 0.01) + 0.001
        colls[d].append({"op": "send", "group": "pp", "seq": 1, "t0": send, "s": done - send})
        colls[d + 2].append({"op": "recv", "group": "pp", "seq": 1, "t0": t + 0.01,
                             "s": done - t - 0.01})
    for stage, start in ((0, t + 0.05), (1, t + 0.2)):
        enter = np.array([start, start + (stage1_late if stage == 1 else 0.0)])
        done = enter.max() + 0.004
        for i, r in enumerate((2 * stage, 2 * stage + 1)):
            colls[r].append({"op": "allreduce", "group": "dp_replicate", "seq": 7,
                             "t0": float(enter[i]), "s": float(done - enter[i])})
    m = {"compute_s": np.full(4, 0.1), "comm_s": np.full(4, 0.01), "step_s": np.full(4, 0.3)}
    return make_frame(lay, 0, m, collectives=colls)


def test_mesh_dimension_groups_are_one_instance_per_stage():
    w = collective_waits(_pp_frame(stage1_late=0.03), floor_s=0.005)
    assert w.instances == 4  # two sends and their receives, and one all-reduce per stage
    assert w.awaited_s[3] > 0.025 and w.partners[3] == {2}  # its stage partner waited
    assert w.awaited_s[:3].max() == 0.0
    assert np.isfinite(w.held_s).all() and w.held_s.max() < 1e-9  # all left together


def test_point_to_point_waits_count_but_name_no_one():
    w = collective_waits(_pp_frame(send_late=0.04), floor_s=0.005)
    assert w.waited_s[2] > 0.035  # rank 2 sat in its receive: a victim
    assert w.awaited_s.max() == 0.0  # but a transfer's seq need not pair it with its sender


def test_a_comm_thread_a_few_ms_late_for_a_few_steps_is_host_noise():
    # the clean nanogpt bench runs: a rank 2-5 ms late out of its calls for 8 steps on a
    # crowded host, its usual 0: over the floor (2 ms there; here 3 % of the step,
    # 5.4 ms), under twice it (a slow link: 14-22 ms)
    for seed in (0, 2):  # the seeds whose jitter lets the lateness clear one floor
        frames = _tp_job(seed=seed, delay=0.014, fault_from=40, fault_until=47)
        outs, _ = run(network, frames)
        assert _named(outs) == [], seed
        outs, _ = run(network, frames, network.NetworkConfig(late_return_floor_s=0.0))
        assert {r for _, s in _named(outs) for r in s.ranks} == {2}, seed

"""Network victims: ranks late only because they waited for someone else (a pipeline
stage for its upstream neighbour, a bystander for a slow link) are not named."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.network import detector as network
from rankscope.detectors.network.waits import collective_waits
from support.network_steps import blamed, dp_step
from support.synth import layout, make_frame
from support.synth import run_detector as run


def test_cascade_through_pipeline_blames_the_root_not_the_victims():
    """Rank 1 (stage 0) delays its dp all-reduce; rank 5 (stage 1) waits for it in p2p

    and then arrives late to stage 1's all-reduce: rank 5 is a victim.
    """
    lay = layout(4, 1, 2)
    w = 8
    frames = []
    for step in range(12):
        t = 1.7e9 + step
        colls = [[] for _ in range(w)]
        fault = step >= 6  # after the job's arrival noise is known
        enter = t + np.full(w, 0.1)
        ready = enter.copy()
        if fault:
            ready[1] += 0.2
        done0 = ready[:4].max() + 0.002
        for r in range(4):  # rank 1 enters late (t0 stamped at the real call)
            colls[r].append({"op": "allreduce", "group": "dp", "seq": step, "t0": ready[r],
                             "s": done0 - ready[r]})
        # stage 0 sends to stage 1 after its all-reduce; rank 5's recv waits for rank 1
        for d in range(4):
            src, dst = d, d + 4
            send_t0 = done0 if fault and d == 1 else enter[src] + 0.01
            recv_t0 = enter[dst] + 0.01
            finish = max(send_t0, recv_t0) + 0.001
            colls[src].append({"op": "send", "group": "pp", "seq": step, "t0": send_t0,
                               "s": finish - send_t0})
            colls[dst].append({"op": "recv", "group": "pp", "seq": step, "t0": recv_t0,
                               "s": finish - recv_t0})
        arrive1 = np.array([max(c[-1]["t0"] + c[-1]["s"], enter[4 + i]) + 0.05
                            for i, c in enumerate(colls[4:])])
        done1 = arrive1.max() + 0.002
        for i in range(4):
            colls[4 + i].append({"op": "allreduce", "group": "dp", "seq": step, "t0": arrive1[i],
                                 "s": done1 - arrive1[i]})
        comm = np.array([sum(c["s"] for c in cs) for cs in colls])
        m = {"compute_s": np.full(w, 0.1), "comm_s": comm, "data_s": np.zeros(w),
             "step_s": np.full(w, 0.5)}
        frames.append(make_frame(lay, step, m, collectives=colls))
    w5 = collective_waits(frames[7], floor_s=0.005)
    assert w5.waited_s[5] > 0.1  # the victim's own wait gives it away
    outs, _ = run(network, frames)
    assert {r for _, rs in blamed(outs) for r in rs} == {1}


def pipeline_steps(steps, rng, slow=None, late=None, onset=30):
    """dp 4 x pp 2 (ranks 4-7 are stage 1): each stage-0 rank computes, sends its
    activations to its stage-1 partner and joins stage 0's all-reduce; each stage-1
    rank receives, computes and joins stage 1's. ``slow``: a stage-0 rank computing
    1.5x from ``onset`` (its partner waits in the receive); ``late``: a stage-1 rank
    whose all-reduce starts 30 ms late from ``onset`` (a slow link of its own)."""
    lay = layout(4, 1, 2)
    frames = []
    for step in range(steps):
        start = 1.7e9 + step + rng.exponential(0.002, 8)
        compute = 0.05 * np.exp(0.05 * rng.standard_normal(8))
        if slow is not None and step >= onset:
            compute[slow] *= 1.5
        colls = [[] for _ in range(8)]
        arrive = np.zeros(8)
        for d in range(4):
            src, dst = d, d + 4
            send_t0, recv_t0 = start[src] + compute[src], start[dst] + 0.001
            finish = max(send_t0, recv_t0) + 0.001
            colls[src].append({"op": "send", "group": "pp", "seq": step, "t0": send_t0,
                               "s": finish - send_t0})
            colls[dst].append({"op": "recv", "group": "pp", "seq": step, "t0": recv_t0,
                               "s": finish - recv_t0})
            arrive[src] = finish + 0.001
            arrive[dst] = finish + compute[dst]
        if late is not None and step >= onset:
            arrive[late] += 0.03
        for stage in (range(4), range(4, 8)):
            done = max(arrive[r] for r in stage) + 0.002
            for r in stage:
                colls[r].append({"op": "allreduce", "group": "dp", "seq": step,
                                 "t0": arrive[r], "s": done - arrive[r]})
        comm = np.array([sum(c["s"] for c in cs) for cs in colls])
        m = {"compute_s": compute, "comm_s": comm, "data_s": np.full(8, 0.0005)}
        m["step_s"] = np.array([max(c["t0"] + c["s"] for c in cs) for cs in colls]) - start
        frames.append(make_frame(lay, step, m, collectives=colls))
    return frames


def test_a_stage_blocked_on_its_slow_upstream_partner_is_not_late_for_its_collective():
    """Rank 1 (stage 0) computes 1.5x; rank 5, its stage-1 partner, waits for its
    activations in the receive and reaches stage 1's all-reduce 25 ms after its
    peers, step after step, with its own compute normal. Its wait in the receive
    explains the lateness: no network finding (8 ranks, bench pp: a bystander named
    for 13-25 steps in every fault run). A stage-1 rank late with no such wait is
    still named."""
    outs, _ = run(network, pipeline_steps(80, np.random.default_rng(31), slow=1))
    assert blamed(outs) == []
    outs, _ = run(network, pipeline_steps(80, np.random.default_rng(31), late=6))
    got = blamed(outs)
    assert got and {r for _, rs in got for r in rs} == {6} and got[0][0] <= 40


def test_a_bystander_that_computed_less_but_waited_for_the_slow_link_is_not_late():
    """Rank 2's link holds every bucket back from step 30; rank 1 computes 10 % less
    from then on (the host gave it a core) and reaches the second bucket early, but
    waits for rank 2 there, so what it saved goes into waiting. Credited
    its shortfall, it was "late for its work" (8 ranks, bench amp and nanogpt: a
    bystander named for 9-13 steps). It waited more than its peers typically did and
    more than its lateness: a victim. Rank 2 alone is named."""
    rng = np.random.default_rng(41)
    lay = layout(8)
    frames = [dp_step(lay, s, rng, delayed=2 if s >= 30 else None, delay=0.02,
                      quick=1 if s >= 30 else None, jitter=0.001) for s in range(70)]
    outs, _ = run(network, frames)
    got = blamed(outs)
    assert got and {r for _, rs in got for r in rs} == {2}

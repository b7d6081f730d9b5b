"""Two replicas of a pipeline stage (detectors/straggler/pair.py): when the slower one's
lag shows in its downstream stage's receives and not in the collectives the two
replicas share (torchtitan's FSDP 2 x PP 2), its pipeline's wait names it; a slower
replica that both pipelines waited for alike stays unattributed, and so does one whose
pipeline waited only on steps where it was not the slower one."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame
from support.synth import run_detector as run

SLOW = 1  # stage 0, dp 1: its pipeline is {1, 3}, its partner's {0, 2}


def _coll(op, group, seq, t0, s):
    return {"op": op, "group": group, "seq": seq, "t0": t0, "s": s}


def step_frame(lay, step, compute, rng, downstream_waits):
    """Ranks 0, 1 (stage 0) and 2, 3 (stage 1). Each stage's replicas meet in a
    gradient all-reduce at the step's end, arriving within a millisecond of each other
    (their pipelines held both back alike). The time rank 1 is slower than rank 0
    (``gap``) is waited out by rank 0 in its receive from stage 1, and either by rank 3
    in its receive from rank 1 (``downstream_waits``: its lag lands on its own
    pipeline) or by rank 2 (its partner's pipeline waited as much)."""
    gap = max(compute[SLOW] - compute[0], 0.0)
    recv = 0.004 + 0.002 * rng.random(4)
    recv[0] += gap
    recv[3 if downstream_waits else 2] += gap
    t_start = 1000.0 + step
    end = t_start + compute.max() + 0.01
    colls = []
    for r in range(4):
        jitter = 0.001 * rng.random()
        colls.append([_coll("recv", "0", 2 * step, t_start + 0.001, recv[r]),
                      _coll("allreduce", "dp", step, end + jitter, 0.003 - jitter)])  # fmt: skip
    comm = recv + 0.003
    m = {"compute_s": compute, "data_s": np.full(4, 0.001), "comm_s": comm,
         "step_s": compute + comm + 0.001, "t": t_start + compute + comm + 0.001}  # fmt: skip
    return make_frame(lay, step, m, collectives=colls)


def frames(seed, downstream_waits, factor=1.5, onset=20, steps=36):
    rng = np.random.default_rng(seed)
    lay = layout(2, 1, 2)
    out = []
    for step in range(steps):
        compute = np.where(lay["pp"] == 0, 0.08, 0.10) * np.exp(0.06 * rng.standard_normal(4))
        if step >= onset:
            compute[SLOW] *= factor
        out.append(step_frame(lay, step, compute, rng, downstream_waits))
    return out


def named(outs):
    return {r for o in outs for s in o.signals if not s.unattributed for r in s.ranks}


def test_a_replica_its_downstream_stage_waited_for_is_named():
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed, downstream_waits=True))
        assert named(outs) == {SLOW}, seed
        first = min(i for i, o in enumerate(outs) for s in o.signals if not s.unattributed)
        assert 20 <= first <= 26


def test_a_replica_both_pipelines_waited_for_alike_is_not_named():
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed, downstream_waits=False))
        assert not named(outs), seed


def test_pipeline_waits_on_steps_it_was_not_slower_do_not_name_it():
    """From step 20 rank 1 is 1.6x slow on odd steps, where nobody waits for it (its
    partner's wait lies in its own pipeline's receive); on even steps it is not slower,
    and its pipeline waits 50 ms in receives for other reasons. Averaged over a window,
    those waits would stand in for the wait its slow steps never caused."""
    rng = np.random.default_rng(4)
    lay = layout(2, 1, 2)
    frames_ = []
    for step in range(60):
        compute = np.where(lay["pp"] == 0, 0.08, 0.10) * np.exp(0.06 * rng.standard_normal(4))
        if step >= 20 and step % 2:
            compute[SLOW] *= 1.6
        f = step_frame(lay, step, compute, rng, downstream_waits=False)
        if step >= 20 and not step % 2:  # its pipeline (and its partner's comm) waits anyway
            for row in (0, 3):
                recv = f.collectives[row][0]
                recv["s"] += 0.05
                f.m["comm_s"][row] += 0.05
        elif step >= 20:  # the partner's wait for it sits in its own pipeline's receive
            f.collectives[2][0]["s"] -= max(compute[SLOW] - compute[0], 0.0)
            f.m["comm_s"][2] -= max(compute[SLOW] - compute[0], 0.0)
        frames_.append(f)
    outs, _ = run(S, frames_)
    assert not named(outs)

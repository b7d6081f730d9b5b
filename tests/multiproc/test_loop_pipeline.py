"""The collector under ``torch.distributed.pipelining``: PP2 x DP3 on 6 real gloo ranks.

Stage 0 is ranks 0-2, stage 1 (the loss) ranks 3-5; ``dp`` is the replica
index within a stage (``tests/support/loops/pipeline_pp.py``). Three replicas
per stage, not two: a one-bit flip is only attributable by a majority of
equal-stage replicas. Faults come from outside the loop: a 1.5x straggler on
rank 1, a flip of one of rank 3's parameters, a NaN in rank 5's logits.

40 ms of emulated device time per micro-batch forward (20 ms elsewhere): the
schedule overlaps the stages, so with 20 ms the straggler slowed the job by
only 1.1x and went unseen. What the detectors make of a pipeline today: the
straggler is found on its rank (``observe`` or ``evict``: the job slows only
~1.15x, near the evict rules' bounds); its pipeline partner (rank 4), which
waits for its activations in ``recv``, may get a ``network`` observe; the
NaN's gradient flows back over the pipeline, so rank 5's upstream partner
(rank 2) is non-finite at the same step and the finding names both (the
detectors do not yet prefer the rank whose loss is non-finite,
``nonfinite_fields``).
"""

from __future__ import annotations

import pytest
from support.loops.faults import Fault
from support.loops.harness import by_kind, med, run_loop, run_until_seen
from support.loops.model import Opts

pytestmark = pytest.mark.multiproc

WORLD, STEPS, MICRO = 6, 30, 2
SLOW_RANK, SLOW_FROM, SLOW_UNTIL = 1, 8, 19
FLIP_RANK, FLIP_STEP = 3, 14
NAN_RANK, NAN_STEP = 5, 27
UPSTREAM = NAN_RANK - 3  # the stage-0 rank of the NaN origin's pipeline
CLEAN = range(2, SLOW_FROM)
SLOW = range(SLOW_FROM + 1, SLOW_UNTIL)


def _assert_fields(steps, world, window):
    dp = world // 2
    for s in window:
        recs = [steps[s][r] for r in range(world)]
        assert [(r["pp"], r["dp"]) for r in recs] == [(p, d) for p in (0, 1) for d in range(dp)]
        for stage in (0, 1):
            mine = recs[dp * stage : dp * stage + dp]
            # replicas of one stage hold equal parameters and reduced gradients;
            # their local gradients are their own data's
            assert len({r["param_digest"] for r in mine}) == 1
            assert len({r["grad_norm_reduced"] for r in mine}) == 1
            assert len({r["grad_norm"] for r in mine}) == dp
        assert recs[0]["param_digest"] != recs[dp]["param_digest"]  # stages differ
        assert all(("loss" in r) == (r["pp"] == 1) for r in recs)  # the last stage's
        for r in recs:
            ops = {(c["op"], c["group"]) for c in r["collectives"]}
            assert ("allreduce", "dp_replicate") in ops  # the stage's gradient reduction
            p2p = {op for op, group in ops if group == "pp"}
            assert p2p & {"send", "recv", "p2p"}, ops  # activations and their gradients
            assert all(c["seq"] > 0 for c in r["collectives"])
            # the waits for the other stage's activations/gradients are comm_s
            waited = sum(c["s"] for c in r["collectives"] if c["group"] == "pp")
            assert r["comm_s"] >= 0.5 * waited > 0, r


def _slow_seen(found) -> bool:
    return any(SLOW_FROM <= f[3] <= SLOW_UNTIL for f in by_kind(found, "straggler"))


def _run(tmp_path, world, schedule, faults, steps):
    """The pipelined loop; with faults, once more when the straggler went unseen while it
    lasted (``run_until_seen``). Returns (steps, opts, findings)."""
    opts = Opts(steps=steps, accum=MICRO, clip=None, work_s=0.04)
    kw = {"opts": opts, "faults": faults, "build_kw": {"schedule": schedule}}
    if faults:
        out, info, found = run_until_seen("pipeline_pp", world, tmp_path, _slow_seen, **kw)
    else:
        (out, info), found = run_loop("pipeline_pp", world, tmp_path, **kw), None
    assert sorted(out) == list(range(steps)), "every iteration is one step record"
    assert all(sorted(out[s]) == list(range(world)) for s in out)
    assert all(not i["faults"] for i in info.values()), info
    return out, opts, found


def test_pipeline_1f1b_pp2_x_dp2_fields(tmp_path):
    steps, _, _ = _run(tmp_path, 4, "1f1b", [], 6)
    _assert_fields(steps, 4, range(2, 6))


def test_pipeline_gpipe_pp2_x_dp3_faults_localized(tmp_path):
    faults = [
        Fault("straggler", SLOW_RANK, SLOW_FROM, SLOW_UNTIL, factor=1.5),
        Fault("flip", FLIP_RANK, FLIP_STEP, until=STEPS),
        Fault("nan", NAN_RANK, NAN_STEP),
    ]
    steps, opts, found = _run(tmp_path, WORLD, "gpipe", faults, STEPS)
    _assert_fields(steps, WORLD, CLEAN)
    # the straggler's forwards take 1.5x: its compute_s grows; the other ranks wait
    slow = med(steps, SLOW_RANK, "compute_s", SLOW)
    peers = [med(steps, r, "compute_s", SLOW) for r in (0, 2)]
    assert slow - max(peers) > 0.3 * opts.work_s * MICRO, (slow, peers)
    slow_comm = med(steps, SLOW_RANK, "comm_s", SLOW)
    assert all(med(steps, r, "comm_s", SLOW) > slow_comm for r in (0, 2))
    flipped = steps[FLIP_STEP]
    assert flipped[FLIP_RANK]["param_digest"] != flipped[4]["param_digest"]
    assert flipped[4]["param_digest"] == flipped[5]["param_digest"]
    at = steps[NAN_STEP]
    assert at[NAN_RANK].get("nonfinite", 0) > 0 and "loss" in at[NAN_RANK]["nonfinite_fields"]
    assert all(at[r].get("nonfinite") == 0 for r in (3, 4))  # its stage peers
    assert at[UPSTREAM].get("nonfinite", 0) > 0  # the NaN gradient it was sent
    assert all(at[r].get("nonfinite") == 0 for r in (0, 1))
    slow_f = by_kind(found, "straggler")
    assert slow_f and all(f[1] == [SLOW_RANK] for f in slow_f), found
    assert SLOW_FROM <= slow_f[0][3] <= SLOW_UNTIL, slow_f
    assert SLOW_FROM - 4 <= slow_f[0][2] <= SLOW_UNTIL, slow_f
    sdc = by_kind(found, "sdc")
    assert sdc and sdc[0][1] == [FLIP_RANK] and sdc[0][2] == FLIP_STEP, found
    nan = by_kind(found, "nonfinite")
    assert nan and nan[0][1] == [UPSTREAM, NAN_RANK] and nan[0][2] == NAN_STEP, found
    assert not [f for f in found if f[4] == "evict" and set(f[1]) - {SLOW_RANK, FLIP_RANK}]
    others = [f for f in found if f[0] not in ("straggler", "sdc", "nonfinite")]
    assert all(f[4] == "observe" and f[1] == [SLOW_RANK + 3] for f in others), found


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_interleaved_pipeline_with_activation_checkpointing_names_its_straggler(
    tmp_path, schedule
):
    """torchtitan's interleaved shapes (``pipeline_interleaved``): two stages per rank
    handed to attach as a list, an optimizer per stage, blocks checkpointed; 1F1B, or
    the V-shaped zero-bubble schedule, whose rank 0 holds the first and the last
    stage. Rank 1 (replica 1) is 1.5x slow. Its replica peer, rank 0, waits out the
    lag at its stages' all-reduces (interleaved: all at the first, the two then arrive
    together at the second; zbv: about half at each), so the pair is attributed on
    its late arrivals summed, not the last collective's (with the last one rank 0 was
    named beside it, unattributed; with the latest one alone, under zbv, the pair
    went unattributed for steps after rank 1 was named)."""
    opts = Opts(steps=STEPS, accum=2, clip=None, work_s=0.02)
    faults = [Fault("straggler", SLOW_RANK, SLOW_FROM, SLOW_UNTIL, factor=1.5)]
    steps, info, found = run_until_seen("pipeline_interleaved", 4, tmp_path, _slow_seen,
                                        opts=opts, faults=faults,
                                        build_kw={"schedule": schedule})  # fmt: skip
    last = {"interleaved": (1,), "zbv": (0,)}[schedule]  # the pp ranks holding the loss
    assert sorted(steps) == list(range(STEPS))
    assert all(sorted(steps[s]) == [0, 1, 2, 3] for s in steps)
    assert all(not i["faults"] for i in info.values()), info
    for s in CLEAN:
        recs = [steps[s][r] for r in range(4)]
        assert [(r["pp"], r["dp"]) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for r in recs:
            ops = [(c["op"], c["group"]) for c in r["collectives"]]
            assert ops.count(("allreduce", "dp_replicate")) == 2  # one per stage held
            assert {"send", "recv"} <= {op for op, group in ops if group == "pp"}
            assert r["data_s"] >= 0 and r["compute_s"] > 2 * opts.work_s  # its stages' forwards
        assert recs[0]["param_digest"] == recs[1]["param_digest"] != recs[2]["param_digest"]
        assert recs[2]["param_digest"] == recs[3]["param_digest"]
        assert all(("loss" in r) == (r["pp"] in last) for r in recs)  # the last stage's
    slow = med(steps, SLOW_RANK, "compute_s", SLOW)
    assert slow > 1.3 * med(steps, 0, "compute_s", SLOW), slow
    slow_f = [f for f in by_kind(found, "straggler") if f[1] == [SLOW_RANK]]
    assert slow_f and SLOW_FROM <= slow_f[0][2] and slow_f[0][3] <= SLOW_UNTIL, found
    # under zbv the peer waits out only ~20 ms of a 45 ms excess (the rest hides in
    # the bubbles), so a step or two may miss the pair rule's wait test: the pair
    # comes out unattributed (observe), about 1 run in 6 before the rank is named
    pair = [f for f in by_kind(found, "straggler") if f[1] != [SLOW_RANK]]
    assert not pair or (schedule == "zbv" and all(
        f[1] == [0, SLOW_RANK] and f[4] == "observe" for f in pair)), found  # fmt: skip
    assert not [f for f in found if f[4] == "evict" and f[1] != [SLOW_RANK]], found

"""The straggler detector on steps that are not the model's usual work: a diverged job
(NaN weights everywhere) and a rank busy with its experts' share of the tokens."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame, diverged
from rankscope.detectors.straggler import detector as S
from support.synth import layout
from support.synth import run_detector as run
from test_detectors_stragglers import blamed, timing_frames


def test_a_diverged_job_is_not_judged_for_timing():
    """Once every rank's local gradient is non-finite (a reduced NaN made the weights
    NaN everywhere) a rank's compute is not the model's work any more: a mixture of
    experts sends every NaN token to one rank's experts. No blame, nothing learnt."""
    rng = np.random.default_rng(3)
    lay = layout(8)
    frames = timing_frames(lay, 30, rng, slow=5, factor=2.0, onset=12)
    for f in frames[12:]:
        f.m["nonfinite"] = np.full(f.n, 4.0)  # the job diverged at step 12
    frames[11].m["nonfinite"] = np.where(frames[11].rank == 2, 1.0, 0.0)  # the NaN's origin
    assert [diverged(f) for f in frames[10:13]] == [False, False, True]
    outs, state = run(S, frames)
    assert not blamed(outs) and not blamed(outs, attributed=False)
    assert state.history.assess(np.array([5]), "compute_s")[0][0] == 12  # steps learnt
    # the same slowdown in a job whose gradients stay finite is found
    outs, _ = run(S, timing_frames(lay, 30, np.random.default_rng(3), slow=5, factor=2.0,
                                   onset=12))  # fmt: skip
    assert {r for _, r in blamed(outs)} == {5}


def _with_alltoall(frames, volume):
    """The frames again, each rank's step carrying one all-to-all of ``volume[rank]`` bytes."""
    out = []
    for f in frames:
        colls = [[{"op": "alltoall", "group": "world", "seq": f.step + 1, "s": 0.001,
                   "bytes": int(volume[r])}] for r in f.rank]  # fmt: skip
        out.append(StepFrame(job=f.job, step=f.step, world=f.world, rank=f.rank, host=f.host,
                             group=f.group, coords=f.coords, m=f.m, digest=f.digest,
                             collectives=colls))  # fmt: skip
    return out


def test_a_rank_whose_experts_get_more_tokens_is_busy_not_slow():
    """Expert parallelism: the rank the router favours computes more and moves more of
    the all-to-all traffic; a slow device moves its share only (expert_load.py)."""
    lay = layout(8)
    loaded = np.full(8, 1_000_000)
    loaded[3] = 1_900_000  # its experts take nearly twice their share of the tokens
    frames = timing_frames(lay, 40, np.random.default_rng(5), slow=3, factor=1.3, onset=0)
    outs, _ = run(S, _with_alltoall(frames, loaded))
    assert not blamed(outs) and not blamed(outs, attributed=False)
    # its device fails too: 1.5x over its own loaded pace is slow, whatever its load
    for f in frames[20:]:
        f.m["compute_s"][3] *= 1.5
    outs, _ = run(S, _with_alltoall(frames, loaded))
    hits = blamed(outs)
    assert {r for _, r in hits} == {3} and 20 <= min(i for i, _ in hits) <= 23
    frames = timing_frames(lay, 40, np.random.default_rng(5), slow=3, factor=1.3, onset=10)
    outs, _ = run(S, _with_alltoall(frames, np.full(8, 1_000_000)))  # a fair router
    assert {r for _, r in blamed(outs)} == {3}

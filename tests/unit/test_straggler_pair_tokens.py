"""Two peers with batches of varying length (detectors/straggler/token_model.py
``per_median_batch``): the pair rules judge compute as if each rank had had its group's
median batch, so a run of long batches on one replica is not slowness, and a replica
slow for its batches still is."""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame
from support.synth import run_detector as run


def frames(seed, *, long_batches=False, slow=1.0, steps=64, onset=30, until=54, jitter=0.03):
    """pp 2 x dp 2 whose batches hold 256-1024 tokens, compute affine in them (20 ms +
    80 ms per 640 tokens, ``jitter`` log sd), each stage's two replicas meeting in their
    all-reduce (the faster waits). From ``onset`` to ``until`` rank 1 gets only long
    batches and rank 0 short ones (``long_batches``), or rank 1 takes ``slow`` times
    longer for its batch."""
    rng = np.random.default_rng(seed)
    lay = layout(2, 1, 2)
    out = []
    for step in range(steps):
        tokens = rng.integers(256, 1025, size=4).astype(float)
        inside = onset <= step < until
        if long_batches and inside:
            tokens[1], tokens[0] = rng.integers(900, 1025), rng.integers(256, 400)
        compute = (0.02 + 0.08 * tokens / 640) * np.exp(jitter * rng.standard_normal(4))
        if inside:
            compute[1] *= slow
        comm = np.maximum(compute, compute[[1, 0, 3, 2]]) - compute + 0.01
        m = {"compute_s": compute, "data_s": np.full(4, 0.001), "comm_s": comm,
             "step_s": compute + comm + 0.001, "tokens": tokens}  # fmt: skip
        out.append(make_frame(lay, step, m))
    return out


def named(outs):
    return {r for o in outs for s in o.signals if not s.unattributed for r in s.ranks}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_run_of_long_batches_on_one_replica_is_not_slowness(seed):
    outs, _ = run(S, frames(seed, long_batches=True))
    assert not named(outs)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_replica_slow_for_its_batches_is_still_named(seed):
    outs, _ = run(S, frames(seed, slow=1.6))
    assert named(outs) == {1}


def test_a_slow_replica_on_long_batches_is_named_by_the_fast_rule_too():
    """The two-peer fast rule (``pair_lead.py``) judges compute per median batch as the
    streak rules do: a proportional token share would excuse a 1.6x replica whose
    batches are 3x its partner's (compute is affine in tokens), and leave it to them."""
    late = []
    for seed in range(1, 9):
        outs, _ = run(S, frames(seed, long_batches=True, slow=1.6))
        steps = [k for k, o in enumerate(outs) if 1 in named([o])]
        assert steps and named(outs) == {1}
        late.append(steps[0] - 30)
    assert float(np.median(late)) <= 3.0

"""Pipeline victims (detectors/straggler/pipeline_victim.py): when a stage slows, its
pipeline partner's step looks slow too; only the rank with the larger excess is named."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame
from support.synth import run_detector as run

DP, PP = 4, 2


def frames(steps, rng, slow=None, echo=None, factor=1.5, echo_factor=1.35, onset=30):
    """PP2 x DP4 (stage 0 ranks 0-3, stage 1 ranks 4-7), 5% jitter; every rank waits in
    its stage's all-reduce for the stage's slowest. ``echo`` is slowed by ``echo_factor``
    at the same steps as ``slow``: the leak of its partner's slowness."""
    lay = layout(DP, pp=PP)
    out = []
    for step in range(steps):
        compute = 0.1 * np.exp(0.05 * rng.standard_normal(DP * PP))
        if step >= onset:
            if slow is not None:
                compute[slow] *= factor
            if echo is not None:
                compute[echo] *= echo_factor
        comm = np.empty_like(compute)
        for p in range(PP):
            stage = slice(p * DP, (p + 1) * DP)
            comm[stage] = compute[stage].max() - compute[stage] + 0.01
        m = {"compute_s": compute, "data_s": np.full(DP * PP, 0.0005), "comm_s": comm}
        m["step_s"] = compute + comm + 0.0005
        out.append(make_frame(lay, step, m))
    return out


def named(outs):
    return {r for o in outs for s in o.signals for r in s.ranks if not s.unattributed}


def test_the_echo_on_the_pipeline_partner_is_not_named():
    outs, _ = run(S, frames(60, np.random.default_rng(1), slow=1, echo=5))
    assert named(outs) == {1}


def test_an_echo_on_another_pipeline_is_a_straggler_of_its_own():
    # rank 6 is in rank 1's stage-1 group but not its pipeline (dp 2, not 1)
    outs, _ = run(S, frames(60, np.random.default_rng(1), slow=1, echo=6))
    assert named(outs) == {1, 6}


def test_a_slow_last_stage_alone_is_named():
    outs, _ = run(S, frames(60, np.random.default_rng(2), slow=5))
    assert named(outs) == {5}


def test_the_larger_excess_is_named_whichever_stage_it_is_on():
    outs, _ = run(S, frames(60, np.random.default_rng(3), slow=5, echo=1))
    assert named(outs) == {5}

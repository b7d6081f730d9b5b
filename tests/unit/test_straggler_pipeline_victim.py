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


def _pairwise(frame, hit, rel, standing):
    """The rule as the module states it, one row at a time (the reference)."""
    rows = np.flatnonzero(hit.any(axis=0))
    key = np.stack([frame.coords[c] for c in ("dp", "tp", "cp", "ep")], axis=1)
    pp = frame.coords["pp"]
    out = np.zeros(frame.n, dtype=bool)
    for row in rows:
        partners = rows[np.all(key[rows] == key[row], axis=1) & (pp[rows] != pp[row])]
        out[row] = bool(((standing[partners] > standing[row]) | (
            (standing[partners] == standing[row]) & (rel[partners] > rel[row]))).any())
    return out


def test_every_pair_is_compared_as_the_rule_says():
    """Many slow rows across pipelines (a slow host), ties in streak and ratio, more rows
    than one block: each row's verdict is the pairwise rule's."""
    from rankscope.detectors.straggler import pipeline_victim as V

    rng = np.random.default_rng(3)
    lay = layout(24, tp=2, pp=4)
    n = lay["rank"].shape[0]
    frame = make_frame(lay, 0, {"compute_s": np.ones(n)})
    for trial in range(30):
        hit = rng.random((2, n)) < (0.9 if trial % 3 == 0 else 0.2)
        rel = rng.choice([1.1, 1.2, 1.3], n)  # ties on purpose
        standing = rng.integers(0, 3, n)
        block, V._BLOCK = V._BLOCK, 7 if trial % 2 else V._BLOCK
        try:
            got = V.pipeline_victims(frame, hit, rel, standing)
        finally:
            V._BLOCK = block
        np.testing.assert_array_equal(got, _pairwise(frame, hit, rel, standing))

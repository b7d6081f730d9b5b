"""A non-finite local gradient that never reached the update is not an incident.

Rank 2's local gradient at step 8 is all NaN (``nonfinite`` counts its elements,
``grad_norm`` is named NaN), as torchtitan 0.3's chunked loss under pipelining
shows on its first step. Where every rank's reduced gradient stays finite and no
loss went non-finite, the update was finite: no finding. Where the NaN reached
the reduction (every replica, or the one shard that holds it) or the rank's loss,
rank 2 is named, as before.
"""

from __future__ import annotations

import pytest
from rankscope.pipeline.engine.engine import Engine
from support.engine_synth import make_records


def _findings(reduced_nan: tuple[int, ...], loss_nan: bool) -> list[tuple]:
    recs = make_records(steps=14, dp=4, tp=1)
    for r in recs:
        if r["step"] != 8:
            continue
        named = {}
        if r["rank"] == 2:
            r["nonfinite"], r["grad_norm"] = 4096, None
            named["grad_norm"] = "NaN"
            if loss_nan:
                r["loss"], named["loss"] = None, "NaN"
        if r["rank"] in reduced_nan:
            r["grad_norm_reduced"], named["grad_norm_reduced"] = None, "NaN"
        if named:
            r["nonfinite_fields"] = named
    eng = Engine()
    eng.feed(recs)
    eng.flush()
    return [(f.kind, f.ranks, f.first_step) for f in eng.findings() if f.kind == "nonfinite"]


def test_a_nan_no_reduction_carries_is_not_an_incident():
    assert _findings(reduced_nan=(), loss_nan=False) == []


@pytest.mark.parametrize("reduced_nan", [(0, 1, 2, 3), (3,)], ids=["every replica", "one shard"])
def test_a_nan_that_reached_the_reduction_names_its_rank(reduced_nan):
    assert _findings(reduced_nan, loss_nan=False) == [("nonfinite", [2], 8)]


def test_a_nan_loss_names_its_rank_even_with_finite_reductions():
    assert _findings(reduced_nan=(), loss_nan=True) == [("nonfinite", [2], 8)]


def _two_rank_findings(ranks_nan: tuple[int, ...], dp: int = 2) -> list[tuple]:
    """A dp ``dp`` job whose ``ranks_nan`` computed a NaN local gradient at step 8, which
    every replica's reduction then carried."""
    recs = make_records(steps=14, dp=dp, tp=1)
    for r in recs:
        if r["step"] == 8:
            named = {"grad_norm_reduced": "NaN"}
            r["grad_norm_reduced"] = None
            if r["rank"] in ranks_nan:
                r["nonfinite"], r["grad_norm"] = 4096, None
                named["grad_norm"] = "NaN"
            r["nonfinite_fields"] = named
    eng = Engine()
    eng.feed(recs)
    eng.flush()
    return [(f.kind, f.ranks, f.first_step, f.unattributed) for f in eng.findings()
            if f.kind == "nonfinite"]  # fmt: skip


def test_a_dp2_nan_beside_a_finite_peer_names_its_rank():
    # half the job, but its peer ran the same weights to a finite gradient
    assert _two_rank_findings((1,)) == [("nonfinite", [1], 8, False)]


def test_a_nan_on_every_rank_or_half_of_four_stays_unattributed():
    assert [f[3] for f in _two_rank_findings((0, 1))] == [True]
    assert [f[3] for f in _two_rank_findings((1, 2), dp=4)] == [True]

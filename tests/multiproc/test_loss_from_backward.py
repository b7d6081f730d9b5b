"""The loss of loops that never call ``rc.loss``, read from their backward
(``collectors/rank/loss_roots.py``) on real gloo ranks: nanoGPT-like DDP with
gradient accumulation, AMP's scaled loss, and a pipeline schedule whose last
stage alone backpropagates a loss."""

from __future__ import annotations

import math

import pytest
from support.loops.faults import Fault
from support.loops.harness import findings, run_loop
from support.loops.model import VOCAB, Opts

pytestmark = pytest.mark.multiproc

CHANCE = math.log(VOCAB)  # cross-entropy of the untrained model's guesses, about


def _losses(steps, ranks):
    return [[steps[s][r].get("loss") for r in ranks] for s in sorted(steps)]


def test_accumulated_micro_step_losses_sum_to_the_steps_mean(tmp_path):
    """``loss / accum`` rounds: their sum is the step's mean, near chance at first. A NaN
    in rank 1's logits at step 4 is its loss's, and only its rank is named."""
    opts = Opts(steps=6, accum=2, report_loss=False, work_s=0.0)
    steps, info = run_loop("ddp_nanogpt", 4, tmp_path, opts=opts, faults=[Fault("nan", 1, 4)])
    assert all(not i["faults"] for i in info.values()), info
    losses = _losses(steps, range(4))
    assert all(0.5 * CHANCE < v < 1.5 * CHANCE for row in losses[:4] for v in row), losses
    assert len({v for row in losses[:4] for v in row}) > 4  # each rank's own data
    assert steps[4][1]["nonfinite_fields"]["loss"] == "NaN"
    assert all(steps[4][r]["loss"] > 0 for r in (0, 2, 3))
    found = findings(tmp_path / "trace")
    assert [(f[0], f[1], f[2]) for f in found] == [("nonfinite", [1], 4)], found


def test_amp_scaled_loss_is_unscaled(tmp_path):
    """Under a 4096x loss scale the root is 4096x the loss; the record is not."""
    steps, info = run_loop("amp_ddp", 3, tmp_path, opts=Opts(steps=6, report_loss=False))
    assert all(not i["faults"] for i in info.values()), info
    losses = _losses(steps, range(3))
    assert all(0.5 * CHANCE < v < 1.5 * CHANCE for row in losses for v in row), losses


def test_a_pipelines_last_stage_records_the_loss_and_the_first_stage_none(tmp_path):
    opts = Opts(steps=4, accum=2, clip=None, report_loss=False, work_s=0.0)
    steps, _ = run_loop("pipeline_pp", 4, tmp_path, opts=opts, build_kw={"schedule": "1f1b"})
    for s in steps:
        first, last = [steps[s][r] for r in (0, 1)], [steps[s][r] for r in (2, 3)]
        assert all("loss" not in r for r in first), first
        # the schedule backpropagates each micro-batch's loss: their sum
        assert all(opts.accum * 0.5 * CHANCE < r["loss"] < opts.accum * 1.5 * CHANCE
                   for r in last), last  # fmt: skip

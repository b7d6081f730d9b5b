"""The fast rule on two peers (detectors/straggler/pair_lead.py): a clear lead over the
partner and over its own history, which the partner waited out, is named at its second
step; a smaller lead, one nobody waited for, and a longer batch are left to the slower
pair rules."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame, replica_pair_frame
from support.synth import run_detector as run

ONSET = 20


def frames(seed, factor=1.6, waits=True, tokens=False, steps=30):
    """pp 2 x dp 2, compute 80/100 ms per stage with 3 % jitter; from ``ONSET`` rank 1
    takes ``factor`` times longer; with ``tokens`` that is because its batches hold
    ``factor`` times its partner's tokens (every rank reports them)."""
    rng = np.random.default_rng(seed)
    lay = layout(2, 1, 2)
    out = []
    for step in range(steps):
        compute = np.where(lay["pp"] == 0, 0.08, 0.10) * np.exp(0.03 * rng.standard_normal(4))
        tok = np.full(4, 1000.0)
        if step >= ONSET:
            compute[1] *= factor
            tok[1] *= factor
        frame = replica_pair_frame(lay, step, compute, rng, waits)
        if tokens:
            m = dict(frame.m, tokens=tok)
            frame = make_frame(lay, step, m)
        out.append(frame)
    return out


def named(outs, rule=None):
    """(step, rank) of each attributed signal, of ``rule`` only when given."""
    return [(i, r) for i, o in enumerate(outs) for s in o.signals
            if not s.unattributed and rule in (None, s.evidence.get("rule"))
            for r in s.ranks]  # fmt: skip


def test_a_clear_lead_the_partner_waited_out_is_named_at_its_second_step():
    off = S.StragglerConfig(pair_lead_strong_over=0.0)
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed))
        got = named(outs, "pair_lead")
        assert got and got[0] == (ONSET + 1, 1), (seed, got)
        assert {r for _, r in named(outs)} == {1}
        first = next(s for s in outs[ONSET + 1].signals if s.evidence.get("rule") == "pair_lead")
        assert first.evidence["streak_steps"] == 2  # onset: the lead's first step
        without, _ = run(S, frames(seed), cfg=off)
        assert min(i for i, _ in named(without)) > ONSET + 1, seed  # the rule does the work


def test_a_lead_under_the_partner_margin_is_left_to_the_pair_rules():
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed, factor=1.3))
        assert not named(outs, "pair_lead"), seed


def test_a_lead_nobody_waited_for_is_not_named():
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed, waits=False))
        assert not named(outs), seed


def test_a_longer_batch_is_allowed_its_tokens():
    for seed in (1, 2, 3):
        outs, _ = run(S, frames(seed, tokens=True))
        assert not named(outs, "pair_lead"), seed


def test_the_rule_is_configurable():
    try:
        S.StragglerConfig(pair_lead_over=1.6, pair_lead_strong_over=1.5)
    except ValueError as e:
        assert "pair_lead_over" in str(e)
    else:
        raise AssertionError("a mild margin above the strong one was accepted")

"""Two peers on a quiet job (detectors/straggler/pair_gap.py): a mild replica is named.

On a GPU-like job two replicas' compute differs by a few percent, so a 1.15x
replica is many of their spreads away; the gap the rule asks comes down from
``pair_gap_ratio`` (1.2x, a crowded host's freed core doubles a gap) to the
groups' 1.1x where the pair's learnt spread is small. With tokens a quiet pair's
usual gap is learnt from its readings per median batch alone: a spread learnt on
raw compute of batches of +-50 % hid a 1.17x gap (q150p, thirty-fifth session).
"""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.detectors.straggler import detector as S
from support.synth import run_detector as run
from test_straggler_pair_gap import frames, named
from test_straggler_pair_tokens import frames as token_frames


def _token_frames(seed, *, slow=1.18, onset=60, steps=150, jitter=0.01):
    """pp 2 x dp 2 with batches of 256-1024 tokens (test_straggler_pair_tokens.py); from
    ``onset`` rank 1 takes ``slow`` times longer."""
    return token_frames(seed, slow=slow, steps=steps, onset=onset, until=steps, jitter=jitter)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_quiet_replica_a_little_slower_is_named_on_its_gap(seed):
    """1.5 % jitter a rank: a 1.18x replica (under the 1.2x the rule asks of a noisy
    pair) is named, from its own onset; a noisy pair's 1.15x gap is not."""
    quiet = frames(np.random.default_rng(seed), slow=1.18, faster=1.0, onset=30, steps=70,
                   jitter=0.015, start_until=0)  # fmt: skip
    outs, _ = run(S, quiet)
    got = named(outs)
    assert got and {s.ranks for _, s in got} == {(1,)}
    first, sig = got[0]
    assert first <= 30 + 14 and 30 <= sig.evidence["onset_step"] <= first
    noisy = frames(np.random.default_rng(seed), slow=1.15, faster=1.0, onset=30, steps=70,
                   jitter=0.12, start_until=0)  # fmt: skip
    assert not named(run(S, noisy)[0])


@pytest.mark.parametrize("seed", [1, 2])
def test_a_pair_with_tokens_learns_its_usual_gap_per_median_batch(seed):
    outs, state = run(S, _token_frames(seed))
    assert float(state.pair_gap.spread[1]) < 0.05  # not the raw batches' +-50 %
    got = named(outs)
    assert got and {s.ranks for _, s in got} == {(1,)}
    first, sig = got[0]
    assert first <= 60 + 14 and 60 <= sig.evidence["onset_step"] <= first
    clean, _ = run(S, _token_frames(seed, slow=1.0))
    assert not [s for o in clean for s in o.signals]


def test_a_noisy_pair_with_tokens_keeps_its_raw_readings_in_the_usual_gap():
    """6 % jitter a rank: per median batch its spread is no quiet pair's, so the usual gap
    keeps the raw readings' width (a crowded host's 12-20 step drifts of 1.3x between two
    varlen replicas named healthy ranks when it did not)."""
    outs, state = run(S, _token_frames(4, slow=1.0, jitter=0.06))
    pg = state.pair_gap
    assert pg.base_s[:, 1].sum() >= 8 and not pg.by_batch.any()
    assert float(pg.spread[1]) > pg.quiet_spread


def test_the_pair_gap_state_round_trips_with_its_readings_per_median_batch():
    _, state = run(S, _token_frames(5, slow=1.0, steps=80))
    pg = state.pair_gap
    assert pg.by_batch[:4].all()
    back = S.StragglerState(S.StragglerConfig())
    back.load_state_dict(state.state_dict())
    for k in ("base_s", "sc", "by_batch", "spread", "usual"):
        assert np.array_equal(getattr(back.pair_gap, k)[..., :4], getattr(pg, k)[..., :4]), k

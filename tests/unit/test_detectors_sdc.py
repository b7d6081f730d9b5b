"""SDC and non-finite detectors: digest, reduced-norm and signature votes, spikes, NaN origin."""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.detectors import metric_outlier, nonfinite_origin
from rankscope.detectors.votes import check as check_vote
from rankscope.detectors.votes import digest as digest_vote
from rankscope.detectors.votes import reduced_grad
from rankscope.detectors.votes.vote import vote
from support.synth import layout, make_frame
from support.synth import run_detector as run


def digests(lay, step, bad=(), value="flipped"):
    d = np.array([f"{g:04x}:{step}" for g in lay["group"]], dtype=object)
    for r in bad:
        d[r] = value
    return d


def test_vote_needs_strict_majority_of_at_least_two():
    assert vote(["a", "a", "b"]).minority == [2]
    assert not vote(["a", "b"]).attributable
    assert not vote(["a", "a", "b", "b"]).attributable
    assert vote(["a", None, "a", "b"]).minority == [3]
    assert not vote([None, None]).split


def test_digest_minority_attributed_at_once_and_until_recovered():
    lay = layout(4, 2, 1)
    frames = []
    for step in range(8):
        bad = (5,) if 3 <= step <= 5 else ()
        frames.append(make_frame(lay, step, digest=digests(lay, step, bad)))
    outs, state = run(digest_vote, frames)
    per_step = [sorted(r for s in o.signals for r in s.ranks) for o in outs]
    assert per_step == [[], [], [], [5], [5], [5], [], []]
    sig = outs[3].signals[0]
    assert sig.kind == "sdc" and sig.severity == "persistent" and not sig.unattributed
    assert sig.evidence["value"] == "flipped" and sig.evidence["voters"] == 4
    restored = digest_vote.DigestVoteState()
    restored.load_state_dict(state.state_dict())
    assert restored.replicated == state.replicated == {0, 1}


def test_digest_two_replicas_unattributed_and_sharded_params_ignored():
    lay = layout(2, 1, 1)
    frames = [make_frame(lay, s, digest=digests(lay, s, (1,) if s >= 2 else ())) for s in range(4)]
    outs, _ = run(digest_vote, frames)
    sigs = [s for o in outs for s in o.signals]
    assert sigs and all(s.unattributed and s.ranks == (0, 1) for s in sigs)
    # every replica different from the start (FSDP shards): not a replica set, no signal
    lay = layout(4)
    frames = [make_frame(lay, s, digest=np.array([f"{r}:{s}" for r in range(4)], dtype=object))
              for s in range(3)]
    outs, _ = run(digest_vote, frames)
    assert not any(o.signals for o in outs)


def test_shards_that_only_agree_once_their_weights_are_nan_are_not_replicas():
    # FSDP shards differ; after a NaN every shard is all NaN and hashes alike, then
    # the NaN payloads differ again: no replica set was learnt, so no SDC finding
    lay = layout(2, 2, 1)
    shards = [f"shard{r}" for r in range(4)]
    frames = []
    for s in range(8):
        nan = s >= 3
        d = np.array(["nan-a" if nan and (s < 5 or r) else
                      "nan-b" if nan else f"{shards[r]}:{s}" for r in range(4)], dtype=object)
        frames.append(make_frame(lay, s, {"nonfinite": np.full(4, 9.0 if nan else 0.0)},
                                 digest=d))  # fmt: skip
    outs, state = run(digest_vote, frames)
    assert not any(o.signals for o in outs) and not state.replicated
    # the same digests on steps that report nothing non-finite: learnt, then reported
    for f in frames:
        f.m["nonfinite"][:] = 0.0
    outs, state = run(digest_vote, frames)
    assert state.replicated and any(s.unattributed for o in outs for s in o.signals)


def test_digest_absent_and_missing_ranks():
    lay = layout(5, 1, 1)
    d = digests(lay, 0, (2,))
    d[0] = None
    f = make_frame(lay, 0, digest=d, rows=np.array([0, 1, 2, 4]))
    outs, _ = run(digest_vote, [f, make_frame(lay, 1)])
    assert [s.ranks for s in outs[0].signals] == [(2,)]
    assert not outs[1].signals


def test_reduced_norm_minority_and_tolerance():
    lay = layout(4, 1, 2)
    red = np.repeat([3.0, 5.0], 4) * (1 + 1e-9 * np.arange(8))  # within tolerance
    red[6] = 5.5
    outs, _ = run(reduced_grad, [make_frame(lay, 0, {"grad_norm_reduced": red})])
    assert [s.ranks for s in outs[0].signals] == [(6,)]
    sig = outs[0].signals[0]
    assert sig.severity == "oneshot" and sig.evidence["peer_median"] == pytest.approx(5.0)
    lay2 = layout(2)
    frames = [make_frame(lay2, 0, {"grad_norm_reduced": np.array([1.0, 1.0])}),
              make_frame(lay2, 1, {"grad_norm_reduced": np.array([1.0, 1.2])})]
    outs, _ = run(reduced_grad, frames)
    assert [(s.ranks, s.unattributed) for s in outs[1].signals] == [((0, 1), True)]


def test_check_vote():
    checks = [
        {"rank": r, "check": "replay:block.3", "group": "g0", "signature": "ok"} for r in range(3)
    ] + [
        {"rank": 3, "check": "replay:block.3", "group": "g0", "signature": "bad"},
        {"rank": 4, "check": "replay:block.1", "group": "g1", "signature": "x"},
        {"rank": 5, "check": "replay:block.1", "group": "g1", "signature": "y"},
        {"rank": 6, "check": "replay:block.1"},  # malformed: ignored
    ]
    lay = layout(8)
    outs, _ = run(check_vote, [make_frame(lay, 0, checks=checks)])
    got = sorted((s.ranks, s.unattributed) for s in outs[0].signals)
    assert got == [((3,), False), ((4, 5), True)]


def norm_frames(lay, steps, rng, spike=None, at=10, factor=1e4, metric="grad_norm"):
    w = lay["rank"].shape[0]
    frames = []
    for step in range(steps):
        m = {
            "grad_norm": (1.0 + 0.2 * lay["pp"]) * (1 + 0.15 * rng.standard_normal(w)),
            "loss": 2.5 + 0.1 * rng.standard_normal(w),
        }
        if spike is not None and step == at:
            m[metric][spike] *= factor
        frames.append(make_frame(lay, step, m))
    return frames


def test_grad_spike_found_at_once_noise_not():
    rng = np.random.default_rng(11)
    lay = layout(16, 1, 2)
    outs, _ = run(metric_outlier, norm_frames(lay, 30, rng, spike=20, at=12))
    hits = [(i, s.ranks) for i, o in enumerate(outs) for s in o.signals]
    assert hits == [(12, (20,))]
    sig = outs[12].signals[0]
    assert sig.kind == "sdc" and sig.severity == "oneshot"
    assert sig.evidence["metric"] == "grad_norm" and sig.evidence["history_median"] is not None
    outs, _ = run(metric_outlier, norm_frames(lay, 60, rng))
    assert not any(o.signals for o in outs)


def test_loss_outlier_and_rank_that_is_always_high():
    rng = np.random.default_rng(12)
    lay = layout(8)
    frames = norm_frames(lay, 20, rng, spike=2, at=9, factor=5, metric="loss")
    outs, _ = run(metric_outlier, frames)
    got = [(i, s.ranks, s.severity) for i, o in enumerate(outs) for s in o.signals]
    assert got == [(9, (2,), "transient")]  # loss alone: maybe a hard batch
    frames = norm_frames(lay, 20, rng)
    for f in frames:
        f.m["grad_norm"][4] *= 6
    outs, _ = run(metric_outlier, frames)
    # a flagged row never teaches its history, so the corruption keeps being reported
    # (recurring SDC on one rank is what the policy evicts for)
    assert all([s.ranks for s in o.signals] == [(4,)] for o in outs)


def test_nonfinite_blames_local_origin_once_per_incident():
    lay = layout(4, 1, 1)
    ok = {"grad_norm": np.ones(4), "grad_norm_reduced": np.ones(4), "nonfinite": np.zeros(4),
          "loss": np.full(4, 2.0)}
    first = {"grad_norm": np.array([1.0, np.nan, 1.0, 1.0]), "nonfinite": np.array([0, 7, 0, 0]),
             "grad_norm_reduced": np.full(4, np.nan), "loss": np.full(4, 2.0)}
    after = {"grad_norm": np.full(4, np.nan), "nonfinite": np.full(4, 100),
             "grad_norm_reduced": np.full(4, np.nan), "loss": np.full(4, np.nan)}
    seq = [ok, ok, first, after, after, ok, ok, first]
    outs, state = run(nonfinite_origin, [make_frame(lay, i, m) for i, m in enumerate(seq)])
    got = [(i, s.ranks, s.severity) for i, o in enumerate(outs) for s in o.signals]
    assert got == [(2, (1,), "oneshot"), (7, (1,), "oneshot")]
    assert outs[2].signals[0].evidence["basis"] == "local_grad"
    restored = nonfinite_origin.NonfiniteState()
    restored.load_state_dict(state.state_dict())
    assert restored.state_dict() == state.state_dict()


def test_nonfinite_loss_names_the_origin_not_the_partner_it_spread_to():
    """tp: rank 1's loss went NaN, its partner's loss is finite but its gradient took the
    NaN in backward: rank 1 is the origin. A stage that reports no loss stays named (it
    may be the origin under pipelining)."""
    lay = layout(2, 2, 1)
    ok = {"grad_norm": np.ones(4), "grad_norm_reduced": np.ones(4), "nonfinite": np.zeros(4),
          "loss": np.full(4, 2.0)}
    bad = {"grad_norm": np.array([np.nan, np.nan, 1.0, 1.0]), "nonfinite": np.array([5, 9, 0, 0]),
           "grad_norm_reduced": np.full(4, np.nan), "loss": np.array([2.0, np.nan, 2.0, 2.0])}
    outs, _ = run(nonfinite_origin, [make_frame(lay, i, m) for i, m in enumerate([ok, ok, bad])])
    sig = outs[2].signals[0]
    assert sig.ranks == (1,) and not sig.unattributed
    assert sig.evidence["backward_only"] == [0]
    lay = layout(3, 1, 2)  # stage 0 (ranks 0-2) reports no loss; rank 5 of stage 1 went NaN
    ok = {"grad_norm": np.ones(6), "grad_norm_reduced": np.ones(6), "nonfinite": np.zeros(6),
          "loss": np.array([np.nan] * 3 + [2.0] * 3)}
    bad = {"grad_norm": np.array([1.0, 1.0, np.nan, 1.0, 1.0, np.nan]),
           "nonfinite": np.array([0, 0, 4, 0, 0, 8]), "grad_norm_reduced": np.full(6, np.nan),
           "loss": np.array([np.nan] * 5 + [np.inf])}
    outs, _ = run(nonfinite_origin, [make_frame(lay, i, m) for i, m in enumerate([ok, ok, bad])])
    assert outs[2].signals[0].ranks == (2, 5)


def test_a_step_the_grad_scaler_skipped_is_not_an_incident_unless_it_repeats():
    """AMP: one rank's overflow on a skipped step is loss-scale backoff, not a fault;
    the same origin on handled_skips skipped steps in a row is."""
    lay = layout(4, 1, 1)
    ok = {"grad_norm": np.ones(4), "grad_norm_reduced": np.ones(4), "nonfinite": np.zeros(4),
          "loss": np.full(4, 2.0), "skipped": np.zeros(4)}
    skip = {"grad_norm": np.array([1.0, np.inf, 1.0, 1.0]), "nonfinite": np.array([0, 3, 0, 0]),
            "grad_norm_reduced": np.full(4, np.inf), "loss": np.full(4, 2.0),
            "skipped": np.ones(4)}
    seq = [ok, ok, skip, ok, skip, ok, ok]
    outs, _ = run(nonfinite_origin, [make_frame(lay, i, m) for i, m in enumerate(seq)])
    assert not [s for o in outs for s in o.signals]
    cfg = nonfinite_origin.NonfiniteConfig(handled_skips=3)
    outs, _ = run(nonfinite_origin, [make_frame(lay, i, m) for i, m in
                                     enumerate([ok, skip, skip, skip, skip])], cfg)
    got = [(i, s.ranks) for i, o in enumerate(outs) for s in o.signals]
    assert got == [(3, (1,))]
    with pytest.raises(ValueError, match="handled_skips"):
        nonfinite_origin.NonfiniteConfig(handled_skips=0)


def test_nonfinite_reduced_only_is_unattributed_and_absent_columns_are_not_nan():
    lay = layout(4)
    ok = make_frame(lay, 0, {"grad_norm": np.ones(4), "grad_norm_reduced": np.ones(4)})
    bad = make_frame(lay, 1, {"grad_norm": np.ones(4), "grad_norm_reduced": np.full(4, np.inf)})
    outs, _ = run(nonfinite_origin, [ok, bad])
    assert [(s.ranks, s.unattributed) for s in outs[1].signals] == [((0, 1, 2, 3), True)]
    # loss reported only by the last pipeline stage: absent elsewhere is not non-finite
    lay = layout(2, 1, 2)
    loss = np.array([np.nan, np.nan, 2.0, 2.0])
    frames = [make_frame(lay, i, {"loss": loss, "grad_norm": np.ones(4)}) for i in range(3)]
    outs, _ = run(nonfinite_origin, frames)
    assert not any(o.signals for o in outs)


def test_exponent_flip_that_overflows_the_norm_is_sdc_not_nonfinite():
    """grad_norm overflowed (null) while the rank counted zero non-finite elements."""
    lay = layout(4)
    ok = {"grad_norm": np.full(4, 0.4), "nonfinite": np.zeros(4),
          "grad_norm_reduced": np.full(4, 0.25), "loss": np.full(4, 2.0)}
    flip = {**ok, "grad_norm": np.array([0.4, 0.4, 0.4, np.nan]),
            "grad_norm_reduced": np.full(4, np.nan)}
    frames = [make_frame(lay, i, m) for i, m in enumerate([ok, ok, flip, ok])]
    outs, _ = run(metric_outlier, frames)
    got = [(i, s.ranks, s.severity) for i, o in enumerate(outs) for s in o.signals]
    assert got == [(2, (3,), "oneshot")]
    assert outs[2].signals[0].evidence["overflow"] is True
    assert outs[2].signals[0].evidence["metric"] == "grad_norm"
    outs, _ = run(nonfinite_origin, frames)
    assert not any(o.signals for o in outs)  # not a NaN origin, and its aftermath is quiet


def test_reduced_norm_broken_on_one_rank_votes_corrupt():
    lay = layout(4)
    ok = make_frame(lay, 0, {"grad_norm": np.full(4, 0.4), "grad_norm_reduced": np.full(4, 0.25)})
    bad = make_frame(lay, 1, {"grad_norm": np.full(4, 0.4),
                              "grad_norm_reduced": np.array([np.nan, 0.25, 0.25, 0.25])})
    outs, _ = run(reduced_grad, [ok, bad])
    assert [(s.ranks, s.unattributed) for s in outs[1].signals] == [((0,), False)]
    outs, _ = run(nonfinite_origin, [ok, bad])
    assert not any(o.signals for o in outs)

"""Two peers (detectors/straggler/pair.py): their own histories and the other's wait name
the slower one; a job-wide slowdown or a rank nobody waited for stays unattributed."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, replica_pair_frame
from support.synth import run_detector as run


def frames(rng, slow=(1,), factor=1.5, onset=20, steps=36, waits=True, job=1.0):
    """pp 2 x dp 2 (stages of two replicas), compute 80/100 ms per stage with 6% jitter;
    from ``onset`` the ``slow`` ranks take ``factor`` and the whole job ``job`` times
    longer; with ``waits`` a rank's dp peer waits for it in the all-reduce."""
    lay = layout(2, 1, 2)
    out = []
    for step in range(steps):
        base = np.where(lay["pp"] == 0, 0.08, 0.10)
        compute = base * np.exp(0.06 * rng.standard_normal(4))
        if step >= onset:
            compute *= job
            compute[list(slow)] *= factor
        out.append(replica_pair_frame(lay, step, compute, rng, waits))
    return out


def signals(outs):
    return [(i, s.ranks, s.unattributed, s.evidence.get("rule")) for i, o in enumerate(outs)
            for s in o.signals]  # fmt: skip


def test_the_slower_of_two_replicas_is_named_by_its_history_and_its_peers_wait():
    # the fast rule for two peers (pair_lead.py) off: this is the streak rule's test
    cfg = S.StragglerConfig(pair_lead_strong_over=0.0)
    outs, state = run(S, frames(np.random.default_rng(1)), cfg=cfg)
    got = signals(outs)
    assert got and {r for _, ranks, un, _ in got if not un for r in ranks} == {1}
    assert not [g for g in got if g[2]], got  # once named it stays named
    first = min(i for i, *_ in got)
    assert 20 <= first <= 26  # the pair streak its chance rate asks for, early in a job
    assert got[0][3] == "pair"
    # its slow steps never taught its own history, named or only flagged by its pair
    _, hmed, _ = state.history.assess(np.array([1]), "compute_s")
    assert hmed[0] < 0.09
    restored = S.StragglerState(S.StragglerConfig())
    restored.load_state_dict(state.state_dict())
    assert restored.state_dict()["pair_named"] == state.state_dict()["pair_named"]
    assert state.state_dict()["pair_named"]["ranks"] == [1]


def test_a_job_wide_slowdown_names_neither_replica():
    # both replicas of stage 0 and the job slow down 1.4x; rank 1 a little more
    outs, _ = run(S, frames(np.random.default_rng(2), slow=(1,), factor=1.12, job=1.4))
    assert not [g for g in signals(outs) if not g[2]]


def test_a_slower_replica_nobody_waited_for_is_not_named():
    outs, _ = run(S, frames(np.random.default_rng(3), waits=False))
    got = signals(outs)
    assert got and all(un for _, _, un, _ in got), got

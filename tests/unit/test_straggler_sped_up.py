"""A lead that is the peers' doing (detectors/straggler/sped_up.py): on a shared host a
rank that sleeps frees a core and its peers compute faster. The rank that did not slow
down is not named; the rank that did slow down (over its own history) still is, and so
is one its peers waited for in the all-reduce, whatever the host did."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from support.synth import layout, make_frame
from support.synth import run_detector as run


def frames(rng, own: float, peers: float, onset=30, steps=50, rank=3, timings=False,
           link=None):  # fmt: skip
    """8 dp ranks at 0.1 s with 3% jitter; from ``onset`` the rank's compute is ``own``
    times its clean value and every other rank's ``peers`` times theirs, and the others
    wait for it in the all-reduce. ``timings``: the all-reduce's per-rank records too
    (each enters when its compute ends, ``link`` a rank entering 60 ms later still)."""
    lay = layout(8)
    out = []
    for step in range(steps):
        compute = 0.1 * np.exp(0.03 * rng.standard_normal(8))
        if step >= onset:
            scale = np.full(8, peers)
            scale[rank] = own
            compute *= scale
        enter = compute.copy()
        if link is not None and step >= onset:
            enter[link] += 0.06
        comm = enter.max() - compute + 0.01
        m = {"compute_s": compute, "data_s": np.full(8, 0.0005), "comm_s": comm}
        m["step_s"] = compute + comm + 0.0005
        colls = None
        if timings:
            t = 1.7e9 + step
            colls = [[{"op": "allreduce", "group": "dp", "seq": step, "t0": t + enter[r],
                       "s": enter.max() - enter[r] + 0.01}] for r in range(8)]  # fmt: skip
        out.append(make_frame(lay, step, m, collectives=colls))
    return out


def named(outs):
    return {r for o in outs for s in o.signals for r in s.ranks if not s.unattributed}


def test_a_rank_left_behind_by_peers_that_got_a_freed_core_is_not_named():
    # its compute stays at its own median while the others' falls 35%: a 1.5x lead (for
    # the first 12 steps: by then the peers' clean histories have learnt their new pace)
    outs, _ = run(S, frames(np.random.default_rng(1), own=1.0, peers=0.65, steps=42))
    assert named(outs) == set()


def test_a_rank_that_slowed_down_while_its_peers_sped_up_is_named_at_once():
    # a sleeping straggler on a shared host: 1.2x over its history, peers 0.8x theirs
    outs, _ = run(S, frames(np.random.default_rng(2), own=1.2, peers=0.8))
    assert named(outs) == {3}
    first = min(i for i, o in enumerate(outs) for s in o.signals if 3 in s.ranks)
    assert 30 <= first <= 32


def test_a_rank_its_peers_waited_for_is_named_though_the_host_sped_them_up():
    # a neighbour's job ended: the peers now compute 35% faster, the straggler kept its
    # own pace and everyone waits for it in the all-reduce (the nanogpt bench run the
    # guard held back for 16 steps)
    outs, _ = run(S, frames(np.random.default_rng(1), own=1.0, peers=0.65, steps=42,
                            timings=True))  # fmt: skip
    assert named(outs) == {3}
    first = min(i for i, o in enumerate(outs) for s in o.signals if 3 in s.ranks)
    assert 30 <= first <= 32


def test_the_bystander_of_a_late_link_is_not_named():
    # rank 5's link makes it enter the all-reduce last: the rank left behind by its
    # sped-up peers is not the one they waited for
    outs, _ = run(S, frames(np.random.default_rng(1), own=1.0, peers=0.65, steps=42,
                            timings=True, link=5))  # fmt: skip
    assert 3 not in named(outs)

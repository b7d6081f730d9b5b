"""The straggler detector judges compute at each rank's usual wait for a CPU
(``cpu_wait_s``): a spell of waiting is the host's, a wait that lasts the rank's."""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.detectors.straggler import detector as straggler
from rankscope.detectors.straggler.own_time import UsualWait, own_time
from support.synth import layout, make_frame, run_detector

LAY = layout(4)
NET = 0.08  # every rank's own compute per step


def _frames(steps=60, slow_from=20, host_wait=True, sleep=False, report=(0, 1, 2, 3), seed=3):
    """Rank 3 computes 1.5x its peers' wall time from ``slow_from``: its host kept it
    waiting for a core (``cpu_wait_s`` explains the excess) or, with ``sleep``, its own
    work took longer (its wait is its peers')."""
    rng = np.random.default_rng(seed)
    frames = []
    for step in range(steps):
        net = NET * (1 + 0.03 * rng.standard_normal(4))
        comm = np.full(4, 0.1)
        wait = 0.25 * net  # a crowded host: a fifth of the step spent waiting
        comp = net + wait * (net + wait) / (net + wait + comm)  # wall = own + share
        if step >= slow_from:
            extra = 0.5 * comp[3]
            if sleep:
                comp[3] += extra
            else:  # its share of the wait grows by ``extra``
                comp[3] += extra
                wait[3] = (comp[3] - net[3]) * (comp[3] + comm[3]) / comp[3]
        comm = comm + comp.max() - comp  # the faster ranks wait in the all-reduce
        step_s = comp + comm + 0.001
        m = {"compute_s": comp, "comm_s": comm, "data_s": np.full(4, 0.001), "step_s": step_s}
        if host_wait:
            m["cpu_wait_s"] = np.where(np.isin(np.arange(4), report), wait, np.nan)
        frames.append(make_frame(LAY, step, m))
    return frames


def _named(frames):
    outs, _ = run_detector(straggler, frames)
    return {r for out in outs for s in out.signals if s.kind == "straggler" for r in s.ranks}


def test_compute_is_scaled_to_the_ranks_usual_wait():
    frames = _frames(steps=40)
    usual = UsualWait()
    for f in frames[:20]:
        usual.learn(f)
    f = frames[30]  # rank 3 waits more than it did
    q = f.m["cpu_wait_s"] / f.m["step_s"]
    base = usual.usual(f.rank)
    net = own_time(f, usual).m["compute_s"]
    assert np.allclose(net, f.m["compute_s"] * (1 - q) / (1 - base))
    assert net[3] < 0.7 * f.m["compute_s"][3]
    assert np.allclose(net[:3], f.m["compute_s"][:3], rtol=0.05)  # at their usual wait
    assert own_time(f, usual) is own_time(f, usual)  # once per frame
    bare = _frames(steps=1, host_wait=False)[0]
    assert own_time(bare, usual) is bare
    fresh = _frames(steps=1)[0]
    assert np.array_equal(own_time(fresh, UsualWait()).m["compute_s"], fresh.m["compute_s"])


def test_a_rank_its_host_kept_waiting_is_no_straggler():
    assert _named(_frames()) == set()


def test_the_same_wall_times_without_the_wait_name_it():
    assert _named(_frames(host_wait=False)) == {3}


def test_a_rank_slow_in_its_own_work_is_named_with_both_times():
    frames = _frames(sleep=True)
    outs, _ = run_detector(straggler, frames)
    sigs = [s for out in outs for s in out.signals]
    assert {r for s in sigs for r in s.ranks} == {3}
    ev = sigs[0].evidence
    step = next(i for i, out in enumerate(outs) if out.signals)
    assert ev["compute_wall_s"] == pytest.approx(frames[step].m["compute_s"][3], rel=1e-6)
    assert ev["cpu_wait_s"] == pytest.approx(frames[step].m["cpu_wait_s"][3], rel=1e-6)
    q = ev["cpu_wait_s"] / frames[step].m["step_s"][3]
    want = ev["compute_wall_s"] * (1 - q) / (1 - ev["usual_wait_share"])
    assert ev["value"] == pytest.approx(want, rel=1e-5)  # judged at its usual wait


def test_a_group_where_one_rank_lacks_the_wait_keeps_wall_times():
    frames = _frames(report=(0, 1, 3))  # rank 2's writer does not report it
    assert own_time(frames[30], UsualWait()) is frames[30]
    assert _named(frames) == {3}


def test_a_host_that_starves_a_rank_for_good_gets_it_named():
    """A noisy neighbour: the wait lasts, becomes the rank's usual, and its
    compute reads slow again; not within a spell's length."""
    outs, state = run_detector(straggler, _frames(steps=400))
    first = next(i for i, out in enumerate(outs) if out.signals)
    assert 40 < first < 400  # a 40-step spell is not (above)
    assert {r for out in outs for s in out.signals for r in s.ranks} == {3}
    assert state.usual_wait.usual([3])[0] > 1.5 * state.usual_wait.usual([0])[0]
    # since when: the step its wait rose, not the step the judged gap first showed
    onsets = [s.evidence.get("onset_step") for out in outs for s in out.signals]
    assert [o for o in onsets if o is not None and o != 20] == [] and 20 in onsets
    assert state.usual_wait.rise(3)[0] == 20 and state.usual_wait.rise(0) is None


def test_a_rank_slow_in_its_own_work_keeps_its_onset():
    outs, state = run_detector(straggler, _frames(sleep=True, slow_from=30))
    sigs = [s for out in outs for s in out.signals]
    assert sigs and all(s.evidence.get("onset_step", 30) >= 30 for s in sigs)
    assert not [s for s in sigs if "wait_rose_step" in s.evidence]


def test_the_usual_wait_survives_a_restore():
    frames = _frames(steps=80)
    _, state = run_detector(straggler, frames[:50])
    copy = straggler.STATE(straggler.CONFIG())
    copy.load_state_dict(state.state_dict())
    assert np.array_equal(copy.usual_wait.share, state.usual_wait.share, equal_nan=True)
    assert np.array_equal(copy.usual_wait.seen, state.usual_wait.seen)
    assert copy.usual_wait.rise(3) == state.usual_wait.rise(3) is not None  # from step 20
    assert np.array_equal(copy.usual_wait.run, state.usual_wait.run)
    assert copy.usual_wait.usual([0, 3, 9]).tolist()[:2] == state.usual_wait.usual([0, 3]).tolist()
    assert np.isnan(copy.usual_wait.usual([9])[0])  # a rank never seen

"""A fault on top of a chance drift (stats/level_shift.py): the onset is where the slow
run stepped up, not where the drift began; a run of one level keeps its onset."""

from __future__ import annotations

import math

import numpy as np
from rankscope.detectors.frame import work_group
from rankscope.detectors.stats.consensus import peer_consensus, readings
from rankscope.detectors.stats.level_shift import level_shift_back
from rankscope.detectors.stats.peers import PeerCache
from rankscope.detectors.straggler import detector as S
from rankscope.detectors.straggler.slowest_count import SlowestCount, slowest_hits
from support.synth import layout, make_frame


def _back(newest_first, back=None):
    v = np.log(np.asarray([newest_first], dtype=float))
    ok = np.ones_like(v, dtype=bool)
    return int(level_shift_back(v, ok, np.array([back or v.shape[1]]))[0])


def test_a_step_up_inside_the_run_moves_the_onset_to_it():
    rng = np.random.default_rng(5)
    drift = list(1.11 * np.exp(0.04 * rng.standard_normal(14)))
    assert _back([1.52, *drift]) == 1  # named on the fault's first step
    assert _back([1.5, 1.45, 1.55, *drift]) == 3
    missing = np.log(np.array([[1.5, 1.45, 1.0, 1.55, *drift]]))
    ok = np.ones_like(missing, dtype=bool)
    ok[0, 2] = False  # a step without a reading inside the newer part
    assert level_shift_back(missing, ok, np.array([missing.shape[1]]))[0] == 4


def test_one_level_or_a_small_step_keeps_the_onset():
    # one level at crowded-host noise (0.15 in log ratio): the best split of 16 readings
    # clears SHIFT_T in about 0.6 % of runs (then the onset only errs late)
    runs = np.log(1.3) + 0.15 * np.random.default_rng(1).standard_normal((2000, 16))
    backs = level_shift_back(runs, np.ones_like(runs, dtype=bool), np.full(2000, 16))
    assert (backs != 16).mean() < 0.015
    rng = np.random.default_rng(6)
    drift = list(1.11 * np.exp(0.01 * rng.standard_normal(14)))
    assert _back([1.19, 1.2, *drift]) == 16  # clear, but under SHIFT_MIN (1.1x) higher
    assert _back([1.52, 1.5]) == 2  # too short to have an older part
    assert _back([1.52, *drift], back=5) == 1  # only inside the run it is given


def _frame(lay, step, compute):
    """DDP's shape: the others wait in the reduction for the slowest rank."""
    w = compute.shape[0]
    comm = 0.02 + compute.max() - compute
    m = {"compute_s": compute, "comm_s": comm, "step_s": compute + comm + 0.001,
         "data_s": np.full(w, 0.001)}  # fmt: skip
    return make_frame(lay, step, m)


def test_a_fault_after_a_drift_is_dated_from_the_fault():
    """Shaped on a bench run (varlen, 1.25x on rank 2 from step 20): rank 2 was its
    group's slowest, by 1.13x, in 11 of the 15 steps before the fault, and the rule
    named it on the fault's first step with its onset at step 7."""
    lay, cfg = layout(4), S.CONFIG()
    drift_steps = {5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18}
    state, peers, named = SlowestCount(cfg.slowest_steps), PeerCache(), []
    for step in range(30):
        compute = np.full(4, 0.1)
        if step >= 20:
            compute[2] = 0.15
        elif step in drift_steps:
            compute[2] = 0.113
        else:
            compute[2] = 0.105
            compute[step % 2] = 0.112  # another rank is the slowest this step
        f = _frame(lay, step, compute)
        idx = peers.get(work_group(f))
        c = peer_consensus(idx, readings(f, cfg.metrics))
        res = slowest_hits(f, idx, c, cfg.metrics.index("compute_s"), state, cfg)
        named += [(step, step - int(res.onset_back[i]) + 1, res.ratio[i])
                  for i in np.flatnonzero(res.hit)]  # fmt: skip
    assert named and named[0][0] == 20  # the drift alone was not enough
    assert all(onset == 20 for _, onset, _ in named)
    assert math.isclose(named[0][2], 1.5, rel_tol=1e-6)  # the fault's ratio, not the drift's

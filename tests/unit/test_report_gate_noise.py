"""The report gate measures a mild slowdown in the job's own noise (``report_gate.py``).

The gate holds a mild straggler until it has lasted because a crowded host's
chance spells look like one (1.1-1.4x for a few steps, 0.8-4.8 of the job's
sigmas). On a quiet job a 1.2x straggler is ten or more sigmas from chance: the
straggler detector hands the gate its group's learnt per-step sigma
(``noise``), and such a straggler is told on its first confirmed step.
"""

from __future__ import annotations

import math

import numpy as np
from rankscope.detectors.straggler import detector as S
from rankscope.pipeline.engine.incidents import IncidentTracker
from rankscope.pipeline.engine.policy import PolicyConfig
from support.synth import layout
from support.synth import run_detector as run
from test_detectors_stragglers import noisy_frames
from test_straggler_pair_gap import frames as pair_frames


def _reported(frames, policy=None):
    """(rank, onset, step reported) per finding of the detector's signals through the gate,
    and the ``noise`` the straggler signals carried."""
    outs, _ = run(S, frames)
    tr = IncidentTracker("j", policy or PolicyConfig(), merge_gap_steps=2)
    noise = []
    for f, o in zip(frames, outs, strict=True):
        noise += [s.evidence["noise"] for s in o.signals if "noise" in (s.evidence or {})]
        tr.update(f.step, float(f.step), o.signals, lambda rs: ["h0"] * len(rs),
                  step_s=float(np.median(f.m["step_s"])))  # fmt: skip
    found = [(f.ranks[0], f.first_step, f.detected_step) for f in tr.findings.values()]
    return sorted(found), noise


def test_a_quiet_jobs_mild_straggler_is_told_on_its_first_confirmed_step():
    """3% jitter with tokens: a 1.2x rank is named within 3 steps of its onset, and
    reported then: it is far more of this job's sigmas than any chance spell. With
    the noise yardstick off (``clear_sigmas=0``) the gate waits 12 steps for it."""
    frames = noisy_frames(layout(8, 1, 2), 80, np.random.default_rng(21), slow=5, factor=1.2,
                          onset=40, tokens=True, jitter=0.03)  # fmt: skip
    found, noise = _reported(frames)
    assert [(r, s) for r, s, _ in found] == [(5, 40)]
    assert found[0][2] <= 43
    # the yardstick is the job's jitter, and 1.2x is well clear of 6 of it
    assert 0.015 < float(np.median(noise)) < 0.06
    assert math.log(1.2) / float(np.median(noise)) > PolicyConfig().clear_sigmas
    waited, _ = _reported(frames, PolicyConfig(clear_sigmas=0))
    assert [(r, s) for r, s, _ in waited] == [(5, 40)]
    assert waited[0][2] >= 40 + PolicyConfig().degraded_report_steps - 1


def test_a_noisy_jobs_mild_straggler_still_has_to_last():
    """10% jitter: the same yardstick reads a 1.25x rank as a few sigmas, a crowded
    host's chance spell; it is reported only once it has lasted, as before."""
    frames = noisy_frames(layout(8, 1, 2), 120, np.random.default_rng(11), slow=5,
                          factor=1.25, onset=30, tokens=True, jitter=0.1)  # fmt: skip
    found, noise = _reported(frames)
    assert float(np.median(noise)) > 0.08
    assert [r for r, _, _ in found] == [5]
    (_, onset, told), = found
    assert told - onset + 1 >= PolicyConfig().mild_report_steps


def test_two_peers_measure_the_wait_in_their_gaps_spread():
    """Two replicas (pp 2 x dp 2) have no group spread: their signals carry the learnt
    spread of the rank's log gap to its partner (both ranks' jitter: 2 % a rank reads
    about 3 %). A quiet replica 1.28x slower (``pair``) is then told on its first
    signal, not once the mild wait has passed; a noisy pair's spread is far larger."""
    quiet = pair_frames(np.random.default_rng(1), slow=1.28, faster=1.0, onset=40, steps=80,
                        jitter=0.02, start_until=0)  # fmt: skip
    found, noise = _reported(quiet)
    assert 0.02 < float(np.median(noise)) < 0.045
    (rank, onset, told), = found
    outs, _ = run(S, quiet)
    first = min(i for i, o in enumerate(outs) if o.signals)
    assert rank == 1 and 40 <= onset <= first and told == first
    (_, _, waited), = _reported(quiet, PolicyConfig(clear_sigmas=0))[0]
    assert waited >= onset + PolicyConfig().mild_report_steps - 1 > told
    _, loud = _reported(pair_frames(np.random.default_rng(1), slow=1.28, faster=1.0, onset=40,
                                    steps=80, jitter=0.12, start_until=0))  # fmt: skip
    assert float(np.median(loud)) > 0.1

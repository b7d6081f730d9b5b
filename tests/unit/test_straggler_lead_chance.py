"""The fast rule's chance record (detectors/straggler/lead_chance.py): a job whose
namings came to nothing asks longer runs; a straggler that keeps leading never counts."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.straggler import detector as S
from rankscope.detectors.straggler.lead_chance import LeadChance
from support.synth import run_detector as run
from test_straggler_lead import frames, named

RANKS = np.arange(4)


def _feed(rec: LeadChance, named_rank_steps: set[tuple[int, int]], steps: int, quiet=6):
    for step in range(steps):
        rec.update(RANKS, np.array([(step, r) in named_rank_steps for r in RANKS]), quiet)


def test_a_short_naming_followed_by_quiet_counts_once():
    rec = LeadChance()
    _feed(rec, {(10, 2), (11, 2)}, 30)
    assert rec.count == 1 and rec.extra(2) == 1 and rec.extra(0) == 0
    assert not rec.busy()


def test_a_naming_that_goes_on_or_comes_back_soon_is_not_chance():
    rec = LeadChance()
    _feed(rec, {(s, 1) for s in range(10, 40)}, 40)  # still named: a straggler
    assert rec.count == 0
    rec = LeadChance()
    _feed(rec, {(10, 1), (11, 1), (15, 1), (16, 1)}, 20)  # back within the quiet steps
    assert rec.count == 0  # not yet: its second episode is still young
    _feed(rec, set(), 10)
    assert rec.count == 1  # one episode (the first was never let go), now quiet


def test_a_naming_longer_than_the_quiet_steps_is_not_chance():
    rec = LeadChance()
    _feed(rec, {(s, 0) for s in range(10, 17)}, 40)  # seven steps named, then gone
    assert rec.count == 0


def test_the_record_survives_a_restart():
    rec = LeadChance()
    _feed(rec, {(10, 2), (11, 2), (20, 3)}, 22)  # rank 2 counted, rank 3 quiet for 2
    saved = rec.state_dict()
    back = LeadChance()
    back.load_state_dict(saved)
    assert back.count == rec.count == 1
    _feed(rec, set(), 10)
    _feed(back, set(), 10)
    assert back.count == rec.count == 2


def _episodes(outs):
    """First step of each run of lead namings, per rank."""
    eps, last = [], {}
    for step, rank in named(outs, rule="lead"):
        if rank not in last or step - last[rank] > 1:
            eps.append((step, rank))
        last[rank] = step
    return eps


def test_a_jittery_job_names_fewer_healthy_ranks_once_its_namings_came_to_nothing():
    """The jittery job of test_straggler_lead (compute jitters by a third, every rank
    waits for the slowest): 600 clean steps. Without the record the rule names healthy
    ranks again and again; with it, after one or two it asks longer runs."""
    fs = frames(600, np.random.default_rng(5), jitter=0.35, base_comm=0.1)
    without = _episodes(run(S, fs, S.StragglerConfig(lead_chance_cap=0, lead_z=0))[0])
    fs = frames(600, np.random.default_rng(5), jitter=0.35, base_comm=0.1)
    record = _episodes(run(S, fs, S.StragglerConfig(lead_z=0))[0])
    assert len(without) >= 10, without
    assert len(record) <= 3, record


def test_a_straggler_after_chance_namings_is_still_named_first():
    """Chance namings in the clean steps, then a 2x rank from step 300: it is the first
    rank named after the onset, within 15 steps (a jittery job asks longer runs); without
    the record a healthy rank was named first in one of these four jobs."""
    for seed in range(4):
        fs = frames(400, np.random.default_rng(seed), jitter=0.35, base_comm=0.1, slow=3,
                    factor=2.0, onset=300)  # fmt: skip
        outs, state = run(S, fs, S.StragglerConfig(lead_z=0))
        assert state.lead_chance.count >= 1  # the clean steps did name someone by chance
        after = [(s, r) for s, r in named(outs) if s >= 300]
        assert after and after[0][1] == 3 and after[0][0] <= 315, (seed, after[:3])

"""``change_point_back``: where a slow run began, read from a window newest first.

The window a rule fires on is mostly older than the fault (a 16-step pair_gap
window five steps into it); a noisy step among the clean ones must not pull the
onset back before the fault (the pp bench run that said step 10 for a fault
from step 20)."""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.slow_window import change_point_back

# newest first: five steps of the fault, then eleven clean ones with two noisy steps
FAULT = [3.0, 3.0, 3.0, 3.0, 3.0]
CLEAN = [-1.5, 0.0, 3.2, 1.1, 0.4, 0.2, 0.2, -0.8, 0.0, 2.0, -1.5]


def _back(z, ok=None, keep=None) -> int:
    z = np.array([z], dtype=float)
    ok = np.ones_like(z, dtype=bool) if ok is None else np.array([ok])
    return int(change_point_back(z, ok, None if keep is None else np.array([keep]))[0])


def test_a_noisy_clean_step_is_not_the_onset():
    assert _back(FAULT + CLEAN) == len(FAULT)


def test_a_run_that_fills_the_window_spans_it():
    assert _back([2.0] * 16) == 16


def test_missing_readings_are_skipped():
    z = FAULT + [9.0] + CLEAN  # the 9 is a reading the rank did not send
    ok = [True] * 5 + [False] + [True] * len(CLEAN)
    assert _back(z, ok) == len(FAULT)


def test_keep_trims_an_oldest_step_the_rule_would_not_count():
    z = [3.0, 3.0, 3.0, 3.5, 0.0, 0.0]
    keep = [True, True, True, False, True, True]
    assert _back(z) == 4
    assert _back(z, keep=keep) == 3


def test_onsets_err_late():
    # a weaker first step of the fault is left out rather than a clean one let in
    assert _back([3.0, 3.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0]) == 3


def test_a_lone_spike_just_before_the_fault_is_not_its_onset():
    # the pp run whose step 18 read 1.8x its partner, step 19 1.15x, the fault from 20
    assert _back(FAULT + [1.0, 5.0, 0.0, 0.0, 0.0, 0.0]) == len(FAULT)
    # two slow steps in a row are the run's start, though
    assert _back(FAULT + [3.0, 3.0, 0.0, 0.0, 0.0, 0.0]) == len(FAULT) + 2


def test_an_earlier_episode_behind_a_stretch_of_baseline_is_not_the_onset():
    # f40n's fsdp2 1.25x run, named by the window at step 37, newest first: its
    # fault from step 20 (the first 18), five clean steps of no excess, and
    # before them four chance steps at 2 sigmas that had pulled the onset to step 8
    fault = [1.4, 0.1, 1.0, 2.6, 2.2, 2.3, 1.4, 2.4, 0.5, 0.5, 2.1, 0.5, 0.9, 0.3, 2.4, 1.9,
             -0.1, 1.8]
    clean = [0.2, 0.1, 2.5, 0.5, -0.4, -0.9, -0.5, -1.5, 2.1, 2.1, 2.1, 2.0, 0.3, 0.4]
    assert _back(fault + clean) <= len(fault)
    # a dip of a few steps inside a fault does not split it
    assert _back([3.0, 3.0, 0.0, -1.0, 0.0, 3.0, 3.0, 3.0, 0.0, 0.0]) == 8

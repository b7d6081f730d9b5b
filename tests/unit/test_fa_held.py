"""The false-alarm bench's held straggler and its measured-slowdown figures.

A sleep of ``factor - 1`` times a rank's clean compute is partly given back on a
host with fewer cores than ranks, so the bench can hold a straggler at its factor
over its peers instead (``bench/fa_held.py``), and it scores straggler runs by what
they measured as well as by what was injected (``bench/fa_score.py``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fa_held import Board, HeldSleep  # noqa: E402
from fa_score import _compute_ratio, _print_measured  # noqa: E402


def test_the_board_gives_each_rank_its_own_groups_latest_compute(tmp_path):
    path = str(tmp_path / "board")
    boards = [Board(path, 4, r) for r in range(4)]  # one per rank, one shared file
    try:
        assert boards[0].peers(1) == []  # nothing posted yet
        for r, b in enumerate(boards):
            b.post(key=1 + r % 2, compute=0.1 * (r + 1))  # ranks 0, 2: key 1; 1, 3: key 2
        assert boards[0].peers(1) == [0.30000000000000004]
        assert sorted(boards[1].peers(2)) == [0.4]
        boards[2].post(key=1, compute=0.5)
        assert boards[0].peers(1) == [0.5]  # the latest step's
    finally:
        for b in boards:
            b.close()


def _absorbing_host(sleep_s: float, rng: random.Random) -> tuple[float, float]:
    """(own, peer) compute of one step on a crowded host: half the sleep comes back
    as the sleeper's own work speeding up, and its peers speed up a little while it
    sleeps; both jitter by 10 %."""
    work, peer = 0.100, 0.100 - 0.1 * sleep_s
    own = work + sleep_s / 2
    return own * rng.uniform(0.9, 1.1), peer * rng.uniform(0.9, 1.1)


def test_the_held_sleep_brings_the_rank_to_its_factor_where_a_fixed_one_falls_short():
    rng = random.Random(7)
    for factor in (1.25, 1.5):
        fixed, held = [], HeldSleep(factor)
        held.start(0.100)
        ratios = []
        for step in range(60):
            own, peer = _absorbing_host(held.sleep_s, rng)
            held.seen([peer, peer * rng.uniform(0.95, 1.05)])
            held.steer(own)
            if step >= 20:
                ratios.append(own / peer)
            f_own, f_peer = _absorbing_host((factor - 1.0) * 0.100, rng)
            fixed.append(f_own / f_peer)
        ratios.sort()
        fixed.sort()
        assert abs(ratios[len(ratios) // 2] - factor) < 0.05 * factor, (factor, ratios)
        assert fixed[len(fixed) // 2] < factor - 0.05  # the fixed sleep is given back


def test_the_held_sleep_is_never_negative_nor_unbounded():
    held = HeldSleep(1.5)
    held.start(0.1)
    held.seen([0.1])
    for _ in range(50):
        held.steer(10.0)  # far over the target: the sleep goes to zero, not below
    assert held.sleep_s == 0.0
    for _ in range(500):
        held.steer(0.0)  # the host gives everything back: the sleep stops at its cap
    assert held.sleep_s == held.cap == 4.0 * 1.5 * 0.1


def _write(run: Path, rows: list[dict]) -> None:
    run.mkdir()
    with open(run / "rank00000-p1-000.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({"v": 1, "type": "step", "job": "j", "world": 4,
                                 "host": "h", "t": 1.0, **r}) + "\n")  # fmt: skip


def test_a_stragglers_measured_slowdown_is_over_its_own_stage_only(tmp_path):
    # pp 2 x dp 2: stage 1 computes 3x stage 0; rank 3 (stage 1) is 1.2x its replica
    rows = []
    for step in range(4):
        for rank, pp, c in ((0, 0, 0.01), (1, 0, 0.01), (2, 1, 0.03), (3, 1, 0.036)):
            rows.append({"rank": rank, "step": step, "pp": pp, "dp": rank % 2, "compute_s": c})
    _write(tmp_path / "run", rows)
    assert abs(_compute_ratio(tmp_path / "run", 3, 2) - 1.2) < 1e-9


def test_straggler_runs_are_binned_by_what_they_measured(capsys):
    _print_measured([(1.7, 1), (1.6, 3), (1.3, 8), (1.3, None), (1.05, None)])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == [">=", "1.50x", "runs", "2", "recall", "1.00", "latency",
                              "median", "2.0", "max", "3.0"]  # fmt: skip
    assert out[2].split()[:6] == ["1.25-1.50x", "runs", "2", "recall", "0.50", "latency"]
    assert out[3].split()[:6] == ["0.00-1.10x", "runs", "1", "recall", "0.00", "latency"]
    _print_measured([])
    assert capsys.readouterr().out == ""

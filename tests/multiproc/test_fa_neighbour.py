"""The false-alarm bench's noisy neighbour really competes for the faulty rank's core.

Two real gloo ranks, each pinned to a core of its own, record one nanoGPT-shaped
run (``bench/fa_record.py``); from the fault's step a busy process shares rank
1's core (``bench/fa_neighbour.py``). Rank 1's thread then waits for its core
(``cpu_wait_s``) while rank 0's does not, the label says a straggler on rank 1,
and no busy process outlives the run. Whether the detectors name it is the
bench's to measure (it takes ~100 steps: docs/false-alarms.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
from rankscope.pipeline.traces.files import read_trace

pytestmark = pytest.mark.multiproc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

STEPS, FROM = 40, 20


def _hogs() -> list[int]:
    from fa_neighbour import MARK

    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if MARK.encode() in fh.read():
                    out.append(int(pid))
        except (OSError, ValueError):
            pass
    return out


def test_nice_levels_follow_the_slowdown():
    from fa_neighbour import nice_for

    assert [nice_for(f) for f in (2.0, 1.5, 1.25, 1.1)] == [0, 3, 6, 10]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core per rank")
def test_a_neighbour_makes_its_rank_wait_for_its_core(tmp_path):
    from fa_record import record_batch

    fault = {"kind": "neighbour", "factor": 2.0, "rank": 1, "from": FROM, "until": None}
    name = "fault-neighbour2.0-nanogpt-0000"
    record_batch([{"name": name, "style": "nanogpt", "seed": 0, "steps": STEPS,
                   "fault": fault}], tmp_path, world=2)  # fmt: skip
    trace = read_trace(tmp_path / name)
    assert trace.report.bad == 0
    wait = {(r["rank"], r["step"]): r["cpu_wait_s"] for r in trace.records
            if r["type"] == "step"}  # fmt: skip
    assert len(wait) == 2 * STEPS

    def median(rank: int, lo: int, hi: int) -> float:
        return statistics.median(wait[rank, s] for s in range(lo, hi))

    before, after = median(1, 2, FROM), median(1, FROM + 1, STEPS)
    assert after > 1e-3 and after > 3 * before, (before, after)
    assert median(0, FROM + 1, STEPS) < after / 3
    labels = [json.loads(s) for s in (tmp_path / name / "labels.jsonl").read_text().splitlines()]
    assert [(lab["kind"], lab["ranks"], lab["step"]) for lab in labels] == [
        ("straggler", [1], FROM)]
    assert _hogs() == []

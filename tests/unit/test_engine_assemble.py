"""Step assembly: completion, deadlines, order, duplicates, late records, columnar, GPU join."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
from rankscope.pipeline.engine.assemble import AssemblerConfig, StepAssembler
from support.engine_synth import T0, make_records


def _frames(asm: StepAssembler, recs, batch: int = 7, now=None):
    out = []
    for i in range(0, len(recs), batch):
        asm.add_records(recs[i : i + batch], now)
        out.extend(asm.ready(now))
    return out


def test_complete_steps_come_out_in_order_with_rows_sorted_by_rank():
    recs = make_records(steps=6)
    random.Random(1).shuffle(recs)
    asm = StepAssembler()
    frames = _frames(asm, recs) + asm.flush()
    assert [f.step for f in frames] == list(range(6))
    for f in frames:
        assert f.n == 8 and f.world == 8
        assert f.rank.tolist() == list(range(8))
        assert f.missing.size == 0
        # peers share tp (dp=4, tp=2): groups split by tp
        assert len(set(f.group[f.coords["tp"] == 0].tolist())) == 1
        assert f.group[0] != f.group[1]
    assert asm.stats("job-a")["frames"] == 6


def test_a_step_is_built_as_soon_as_every_rank_reported():
    recs = make_records(steps=2)
    asm = StepAssembler()
    asm.add_records(recs[:7])
    assert asm.ready() == []
    asm.add_records(recs[7:8])
    (frame,) = asm.ready()
    assert frame.step == 0


def test_duplicates_last_wins_and_late_records_are_counted():
    recs = make_records(steps=3)
    dup = dict(recs[3], compute_s=9.0)  # rank 3 of step 0 again, later
    asm = StepAssembler()
    asm.add_records(recs[:8])
    (f0,) = asm.ready()
    asm.add_records([dup])  # step 0 was already built: too late
    assert f0.m["compute_s"][3] != 9.0
    assert asm.stats("job-a")["late"] == 1
    # a duplicate while the step is still open replaces the earlier record
    asm.add_records(recs[8:12] + [dict(recs[9], compute_s=7.0)] + recs[12:16])
    (f1,) = asm.ready()
    assert f1.m["compute_s"][1] == 7.0
    assert asm.stats("job-a")["duplicates"] == 1


def test_vanished_rank_becomes_missing_after_the_record_clock_deadline():
    recs = make_records(steps=30, vanish=(5, 10))
    recs.sort(key=lambda r: r["t"])
    asm = StepAssembler(AssemblerConfig(deadline_floor_s=0.5))
    frames = _frames(asm, recs, batch=4)
    # deadline = max(3 x 0.2 s, 0.5 s) = 0.6 s: steps up to ~3 before the end are out
    assert [f.step for f in frames] == list(range(len(frames)))
    assert len(frames) >= 25
    for f in frames:
        assert f.missing.tolist() == ([5] if f.step >= 10 else [])
    assert asm.stats("job-a")["partial_frames"] == len(frames) - 10
    rest = asm.flush()
    assert [f.step for f in rest] == list(range(len(frames), 30))
    assert asm.hosts_of("job-a", [5]) == ["h1"]


def test_wall_clock_deadline_uses_the_callers_now():
    recs = make_records(steps=2, vanish=(2, 0))
    asm = StepAssembler(AssemblerConfig(clock="wall", initial_deadline_s=5.0))
    asm.add_records(recs, now=100.0)
    assert asm.ready(now=104.0) == []
    frames = asm.ready(now=105.5)
    assert [f.step for f in frames] == [0, 1]
    assert frames[0].missing.tolist() == [2]


def test_out_of_range_ranks_are_refused():
    rec = dict(make_records(steps=1)[0], rank=99)
    asm = StepAssembler()
    asm.add_records([rec])
    assert asm.stats("job-a")["refused"] == 1
    assert asm.flush() == []


def _table(recs):
    return pa.Table.from_pylist(recs)


def test_columnar_path_builds_the_same_frames_as_the_dict_path():
    recs = make_records(steps=5, straggler=(3, 1, 1.5))
    shuffled = recs[:]
    random.Random(3).shuffle(shuffled)
    dup = dict(recs[10], compute_s=5.5)  # step 1 rank 2, later: must win
    a, b = StepAssembler(), StepAssembler()
    dict_frames = _frames(a, shuffled + [dup], batch=len(recs) + 1) + a.flush()
    half = len(shuffled) // 2
    b.add_table(_table(shuffled[:half]))
    b.add_table(_table(shuffled[half:] + [dup]))
    col_frames = b.ready() + b.flush()
    assert [f.step for f in col_frames] == [f.step for f in dict_frames] == list(range(5))
    for fa, fb in zip(dict_frames, col_frames, strict=True):
        assert fa.rank.tolist() == fb.rank.tolist()
        assert fa.host.tolist() == fb.host.tolist()
        assert fa.digest.tolist() == fb.digest.tolist()
        np.testing.assert_array_equal(fa.group, fb.group)
        for name in fa.m:
            np.testing.assert_array_equal(fa.m[name], fb.m[name])
    assert col_frames[1].m["compute_s"][2] == 5.5


def test_columnar_path_refuses_bad_rows_and_keeps_the_rest():
    recs = make_records(steps=1)
    bad = [dict(recs[0], rank=None), dict(recs[1], v=2), dict(recs[2], rank=8)]
    asm = StepAssembler()
    refused = asm.add_table(_table(recs + bad))
    assert [r for r, _ in refused] == [8, 9, 10]
    reasons = " ".join(reason for _, reason in refused)
    assert "rank" in reasons and "version" in reasons
    (frame,) = asm.ready()
    assert frame.n == 8


def test_columnar_path_rejects_a_table_without_required_columns():
    with pytest.raises(ValueError, match="host"):
        StepAssembler().add_table(pa.table({"job": ["j"], "rank": [0], "step": [0],
                                            "world": [1], "t": [T0]}))  # fmt: skip


def test_gpu_samples_are_joined_onto_the_step_by_rank_and_by_host_gpu_index():
    recs = make_records(steps=2, dp=2, tp=2, ranks_per_host=2)
    gpu = [
        {"v": 1, "type": "gpu", "job": "job-a", "host": "h0", "gpu": 1, "t": T0 - 1, "rank": 1,
         "temp_c": 71.0, "clock_events": ["hw_slowdown"], "xid": [79], "power_w": 300.0},
        {"v": 1, "type": "gpu", "job": "job-a", "host": "h0", "gpu": 1, "t": T0 - 0.5,
         "rank": 1, "temp_c": 72.0, "xid": [48], "clock_events": ["sw_thermal"],
         "remap_pending": True, "temp_slowdown_c": 87.0},
        {"v": 1, "type": "gpu", "job": "job-a", "host": "h1", "gpu": 0, "t": T0, "temp_c": 60.0},
    ]  # fmt: skip
    asm = StepAssembler()
    asm.add_records(gpu + recs[:4])
    (f0,) = asm.ready()
    assert f0.gpu["temp_c"][1] == 72.0
    assert np.isnan(f0.gpu["temp_c"][0])
    assert f0.gpu["remap_pending"][1] == 1.0
    assert np.isnan(f0.gpu["power_w"][1])  # the latest sample is the reading, as a whole
    assert f0.gpu["temp_slowdown_c"][1] == 87.0  # added numeric fields travel too
    assert f0.gpu["xid"][1] == [79, 48]  # accumulated between steps
    assert f0.gpu["clock_events"][1] == ["sw_thermal"]
    asm.add_records(recs[4:])
    (f1,) = asm.ready()
    assert f1.gpu["temp_c"][2] == 60.0  # h1's GPU 0 is its lowest rank, 2
    assert f1.gpu["xid"][1] is None  # events are reported once


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clock": "sundial"},
        {"deadline_factor": 0},
        {"deadline_floor_s": -1.0},
        {"initial_deadline_s": 0},
        {"recent_steps": 0},
        {"max_pending_steps": 0},
        {"max_world": 0},
    ],
)
def test_assembler_config_checks(kwargs):
    with pytest.raises(ValueError):
        AssemblerConfig(**kwargs)


def test_a_step_sees_the_gpu_samples_of_its_time_even_when_a_batch_holds_many_steps():
    recs = make_records(steps=4, dp=2, tp=1, ranks_per_host=2, step_s=1.0)
    gpu = [{"v": 1, "type": "gpu", "job": "job-a", "host": "h0", "gpu": 0, "rank": 0,
            "t": T0 + s - 0.5, "sm_clock_mhz": 1000.0 + s} for s in range(4)]  # fmt: skip
    asm = StepAssembler()
    asm.add_records(sorted(recs + gpu, key=lambda r: r["t"]))  # one batch, four steps
    frames = asm.ready()
    assert [f.gpu["sm_clock_mhz"][0] for f in frames] == [1000.0, 1001.0, 1002.0, 1003.0]

"""The one validation entry and the assembler's per-job bounds: each crash or blinding case
of issue 17 as a record, and what happens to it now."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest
from rankscope.collectors.schema.records import RecordError
from rankscope.pipeline.bus.decode import decode_message, decode_records
from rankscope.pipeline.engine.assemble import AssemblerConfig
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import read_trace, write_jsonl
from rankscope.pipeline.traces.validate import (
    DEFAULT_MAX_WORLD,
    Limits,
    check_record,
    columns_bounds_reason,
    parse_json,
)
from support.engine_synth import make_records
from support.engine_synth import one_step_record as _step

U64_MAX = 2**64 - 1


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"step": U64_MAX}, "64-bit"),
        ({"step": 10**29}, "64-bit"),
        ({"step": 1.2345678901234568e29}, "64-bit"),  # what orjson makes of a 30-digit step
        ({"rank": -(2**63) - 1}, "64-bit"),
        ({"tokens": 2**63}, "64-bit"),
        ({"world": 2**20, "rank": 0}, "world 1048576 outside 1..65536"),
        ({"world": 0, "rank": 0}, "world 0 outside"),
        ({"rank": 4}, "rank 4 outside 0..3"),
        ({"tp": DEFAULT_MAX_WORLD}, "tp 65536 outside"),
        ({"step": -1}, "negative"),
        ({"t": float("inf")}, "not a time"),
        ({"t": 1e300}, "not a time"),
        ({"host": "h" * 5000}, "5000 characters"),
        ({"job": "j" * 1025}, "1025 characters"),
        ({"collectives": [{"op": "x", "group": "dp", "seq": U64_MAX}]}, "collectives[0]"),
        ({"collectives": [{"op": "x" * 2000, "group": "dp", "seq": 1}]}, "collectives[0]"),
    ],
)
def test_each_bound_is_refused_with_its_reason(over, fragment):
    with pytest.raises(RecordError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_record(_step(**over))
    # the Kafka lane gives the same verdict, alone or in an array of good records
    good, bad = [], []
    decode_records(json.dumps([_step(), _step(**over), _step(rank=2)]).encode(), good, bad)
    assert [r["rank"] for r in good] == [1, 2] and bad[0][0] == 1, bad


def test_values_within_bounds_pass_unchanged():
    for over in ({"step": 2**63 - 1}, {"world": DEFAULT_MAX_WORLD, "rank": DEFAULT_MAX_WORLD - 1},
                 {"t": float("nan")}, {"loss": float("inf")}, {"host": "h" * 1024}):  # fmt: skip
        assert check_record(_step(**over))["host"].startswith("h")
    beat = {"v": 1, "type": "beat", "job": "j", "rank": 0, "host": "h", "t": 1.0, "step": 3,
            "phase": "collective", "coll_ranks": [0, 1, 2**40]}  # fmt: skip
    with pytest.raises(RecordError, match="coll_ranks"):
        check_record(beat)


def test_limits_are_checked():
    for bad in ({"max_world": 0}, {"max_str_len": 0}, {"max_list_len": 0}, {"max_abs_t_s": 0}):
        with pytest.raises(ValueError):
            Limits(**bad)
    with pytest.raises(ValueError):
        AssemblerConfig(max_step_ahead=0)
    with pytest.raises(ValueError):
        AssemblerConfig(max_t_ahead_s=0)


def test_nan_and_infinity_literals_are_read_on_every_lane(tmp_path):
    recs = [_step(rank=r, loss=float("nan") if r == 2 else 1.0, grad_norm=float("inf"))
            for r in range(4)]  # fmt: skip
    text = json.dumps(recs)  # Python's json writes the bare NaN / Infinity tokens
    assert "NaN" in text
    good, bad = [], []
    decode_records(text.encode(), good, bad)
    assert len(good) == 4 and not bad
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    tr = read_trace(path)
    assert len(tr.records) == 4 and tr.report.bad == 0
    assert parse_json(b'{"a": -Infinity}') == {"a": float("-inf")}
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(b"[" * 100_000 + b"NaN" + b"]" * 100_000)


def test_a_kafka_array_keeps_its_good_records_around_a_non_record():
    good, bad = [], []
    decode_message(json.dumps([_step(), 5, _step(rank=2)]).encode(), good, bad)
    assert [r["rank"] for r in good] == [1, 2]
    assert bad[0][:2] == (1, "array element 1 is a int, not a record")
    # the columnar path too: a long array with one bad element keeps the rest
    many = [_step(rank=r % 4, step=r // 4) for r in range(64)]
    many[10] = _step(step=U64_MAX)
    good, bad = [], []
    assert decode_message(json.dumps(many).encode(), good, bad) is None
    assert len(good) == 63 and bad[0][0] == 10


def test_columns_and_records_agree_on_bounds():
    cols = {"rank": [0, 1], "world": [2, 2], "step": [0, U64_MAX], "t": [1.0, 2.0]}
    assert "64-bit" in columns_bounds_reason("step", cols)
    cols["step"] = [0, 1]
    assert columns_bounds_reason("step", cols) is None
    cols["rank"] = [0, 2]
    assert "rank outside" in columns_bounds_reason("step", cols)


def _steps_built(engine, job):
    return engine.stats(job)["frames"]


def test_one_far_step_does_not_blind_the_job():
    recs = make_records(job="blind", dp=4, tp=1, steps=150, ranks_per_host=2)
    poison = {**recs[10 * 4], "step": 2**62}
    eng = Engine()
    eng.feed(recs[: 10 * 4] + [poison])
    eng.feed(recs[10 * 4 :])
    eng.flush()
    stats = eng.stats("blind")
    assert _steps_built(eng, "blind") == 150 and stats.get("late", 0) == 0
    assert stats["ahead"] == 1
    assert eng.job_summary("blind")["last_step"] == 149
    assert all(f.last_step < 150 for f in eng.findings())


def test_a_far_step_confirmed_by_the_ranks_is_taken():
    recs = make_records(job="jump", dp=4, tp=1, steps=20, ranks_per_host=2)
    later = [{**r, "step": r["step"] + 10**6, "t": r["t"] + 100} for r in recs[40:]]
    eng = Engine()
    eng.feed(recs[:40])
    eng.feed(later)
    eng.flush()
    assert eng.job_summary("jump")["last_step"] == 10**6 + 19
    assert eng.stats("jump").get("ahead", 0) == 0


def test_a_claimed_world_does_not_size_the_job():
    recs = make_records(job="w", dp=8, tp=1, steps=30, ranks_per_host=2)
    liars = [{**recs[5 * 8 + i], "world": DEFAULT_MAX_WORLD, "rank": 60_000 + i} for i in range(3)]
    tracemalloc.start()
    eng = Engine()
    eng.feed(liars + recs)
    eng.flush()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert eng.job_summary("w")["world"] == 8
    assert eng.stats("w")["world_mismatch"] == 3
    assert all(max(f.ranks, default=0) < 8 for f in eng.findings())
    assert peak < 60e6, peak  # far below what 65,536-rank frames for every step would take


def test_a_world_claim_before_the_real_ranks_is_outvoted():
    recs = make_records(job="w2", dp=8, tp=1, steps=30, ranks_per_host=2)
    liars = [{**recs[i], "world": 100, "rank": 90 + i} for i in range(3)]
    eng = Engine()
    eng.feed(liars)
    eng.feed(recs)
    eng.flush()
    assert eng.job_summary("w2")["world"] == 8 and eng.stats("w2")["frames"] == 30
    assert not any(f.kind == "crash" for f in eng.findings())


def test_a_record_far_ahead_of_the_job_clock_is_refused():
    recs = make_records(job="clk", dp=4, tp=1, steps=40, ranks_per_host=2)
    bogus = {**recs[20 * 4 + 1], "t": recs[0]["t"] + 1e9}
    eng = Engine()
    eng.feed(recs[: 20 * 4] + [bogus] + recs[20 * 4 :])
    eng.flush()
    stats = eng.stats("clk")
    assert stats["t_ahead"] == 1 and stats["frames"] == 40
    assert stats.get("partial_frames", 0) == 0


def test_out_of_bound_records_in_a_trace_are_reported_and_the_rest_replays(tmp_path):
    recs = make_records(job="tr", dp=4, tp=1, steps=30, ranks_per_host=2)
    bad = [{**recs[3], "step": U64_MAX}, {**recs[4], "step": 10**29}]
    d = tmp_path / "trace"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs[:60] + bad) + "\n")
    write_jsonl(recs[60:], d / "b.jsonl.gz")
    corrupt = d / "c.jsonl.gz"  # a gzip header, then a broken deflate stream
    corrupt.write_bytes(gzip.compress(b"x" * 1000)[:10] + b"\xff" * 64)
    res = replay_trace(d)
    assert res.report.bad == 3
    reasons = [e.reason for e in res.report.errors]
    assert sum("64-bit" in r for r in reasons) == 2
    assert any("corrupt" in r for r in reasons)
    assert res.jobs[0]["last_step"] == 29 and res.jobs[0]["frames"] == 30

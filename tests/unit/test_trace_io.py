"""Reading and writing traces: formats, bad lines, duplicates, several jobs."""

import gzip
import json

import pytest
from rankscope.collectors.schema.records import BeatRecord, RecordError, StepRecord, validate_record
from rankscope.pipeline.traces.files import (
    iter_records,
    read_labels,
    read_trace,
    write_jsonl,
    write_labels,
    write_meta,
    write_parquet,
)


def step(rank, stp, job="j", **kw):
    return StepRecord(job=job, rank=rank, step=stp, world=4, host=f"h{rank // 2}", t=100.0 + stp,
                      **kw).to_dict()


def test_round_trip_jsonl_gzip_and_parquet(tmp_path):
    recs = [step(r, s, compute_s=0.01 * (r + 1), collectives=[
        {"op": "allreduce", "group": "dp", "seq": s, "bytes": 1024, "s": 0.002}])
        for r in range(4) for s in range(3)]
    write_jsonl(recs[:6], tmp_path / "a.jsonl")
    write_jsonl(recs[6:9], tmp_path / "b.jsonl.gz")
    write_parquet(recs[9:], tmp_path)
    trace = read_trace(tmp_path)
    assert trace.report.bad == 0
    assert trace.report.files == 3
    got = sorted(trace.records, key=lambda r: (r["rank"], r["step"]))
    assert got == sorted(recs, key=lambda r: (r["rank"], r["step"]))


def test_malformed_lines_reported_with_file_line_reason_and_rest_kept(tmp_path):
    good = [step(r, 1) for r in range(4)]
    lines = [
        json.dumps(good[0]),
        "{not json",
        json.dumps({"v": 1, "type": "step", "job": "j", "rank": 1}),  # missing fields
        json.dumps(good[1]),
        json.dumps({**good[2], "rank": "two"}),  # wrong type
        json.dumps({**good[2], "v": 7}),  # unknown version
        "",
        json.dumps(good[2]),
        json.dumps({"v": 1, "type": "mystery", "job": "j"}),
        json.dumps(good[3]),
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    trace = read_trace(f)
    assert sorted(r["rank"] for r in trace.records) == [0, 1, 2, 3]
    assert trace.report.bad == 5
    where = [(e.line, e.reason) for e in trace.report.errors]
    assert [w[0] for w in where] == [2, 3, 5, 6, 9]
    assert all(e.file == str(f) for e in trace.report.errors)
    assert "bad JSON" in where[0][1]
    assert "missing required field" in where[1][1]
    assert "'rank' should be int" in where[2][1]
    assert "unknown format version" in where[3][1]
    assert "unknown record type" in where[4][1]


def test_truncated_gzip_keeps_what_was_read(tmp_path):
    f = tmp_path / "t.jsonl.gz"
    write_jsonl([step(r, s) for r in range(4) for s in range(200)], f)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    report_trace = read_trace(f)
    assert 0 < len(report_trace.records) < 800
    assert report_trace.report.bad == 1
    assert "truncated" in report_trace.report.errors[0].reason


def test_duplicates_last_wins_any_order_several_jobs(tmp_path):
    recs = [step(1, 5, loss=1.0), step(0, 5), step(1, 5, loss=2.0), step(0, 4, job="other"),
            step(0, 3)]
    write_jsonl(recs, tmp_path / "x.jsonl")
    trace = read_trace(tmp_path / "x.jsonl")
    keyed = {(r["job"], r["rank"], r["step"]): r for r in trace.records}
    assert len(trace.records) == 4
    assert keyed[("j", 1, 5)]["loss"] == 2.0
    assert ("other", 0, 4) in keyed


def test_int_fields_accept_whole_floats_and_reject_bools():
    rec = validate_record({**step(0, 1), "step": 3.0})
    assert rec["step"] == 3 and isinstance(rec["step"], int)
    with pytest.raises(RecordError):
        validate_record({**step(0, 1), "step": 3.5})
    with pytest.raises(RecordError):
        validate_record({**step(0, 1), "rank": True})


def test_beat_phase_and_collectives_checked():
    beat = BeatRecord(job="j", rank=0, host="h", t=1.0, step=2, phase="collective").to_dict()
    assert validate_record(beat)["phase"] == "collective"
    with pytest.raises(RecordError, match="phase"):
        validate_record({**beat, "phase": "napping"})
    with pytest.raises(RecordError, match=r"collectives\[0\]"):
        validate_record({**step(0, 1), "collectives": [{"op": "allreduce"}]})


def test_meta_and_labels(tmp_path):
    write_meta(tmp_path, {"job": "j", "world": 4, "ranks_per_host": 2})
    write_labels(tmp_path, [{"kind": "straggler", "ranks": [3], "hosts": ["h1"], "step": 10,
                             "until": None}])
    with open(tmp_path / "labels.jsonl", "a") as fh:
        fh.write('{"kind": "gremlin", "ranks": [1], "step": 2}\n')
    write_jsonl([step(0, 1)], tmp_path / "r.jsonl.gz")
    trace = read_trace(tmp_path)
    assert trace.meta[0]["format"] == "rankscope-trace"
    assert [lab["kind"] for lab in trace.labels] == ["straggler"]
    assert trace.report.bad == 1 and "gremlin" in trace.report.errors[0].reason
    assert read_labels(tmp_path / "r.jsonl.gz")[0]["ranks"] == [3]


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace"):
        list(iter_records([tmp_path / "nope"], report=None))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a trace file"):
        list(iter_records([tmp_path / "notes.txt"], report=None))


def test_gzip_members_concatenated(tmp_path):
    """Collectors that append gzip members (rotation, crash-restart) stay readable."""
    f = tmp_path / "c.jsonl.gz"
    with open(f, "wb") as fh:
        for s in range(3):
            fh.write(gzip.compress((json.dumps(step(0, s)) + "\n").encode()))
    assert len(read_trace(f).records) == 3

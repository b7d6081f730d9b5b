"""``iter_records_by_time``: a trace's files merged by ``t``, one record per file held."""

from __future__ import annotations

import random

from rankscope.pipeline.traces.files import ReadReport, iter_records, write_jsonl
from rankscope.pipeline.traces.merge import iter_records_by_time
from support.engine_synth import make_records
from support.paths import SAMPLE_TRACES


def test_files_per_rank_come_back_in_time_order(tmp_path):
    recs = make_records(steps=20)
    for r in range(8):
        write_jsonl([x for x in recs if x["rank"] == r], tmp_path / f"rank{r}.jsonl")
    report = ReadReport()
    got = list(iter_records_by_time([tmp_path], report))
    assert [x["t"] for x in got] == sorted(x["t"] for x in recs)
    assert report.files == 8 and report.bad == 0
    # file order is rank by rank: the control
    plain = list(iter_records([tmp_path], ReadReport()))
    assert [x["rank"] for x in plain[:20]] == [0] * 20


def test_bad_lines_are_reported_and_nothing_else_lost(tmp_path):
    recs = make_records(steps=5)
    write_jsonl([x for x in recs if x["rank"] % 2 == 0], tmp_path / "a.jsonl")
    lines = [ln for ln in (tmp_path / "a.jsonl").read_text().splitlines()]
    lines.insert(3, "{broken")
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    write_jsonl([x for x in recs if x["rank"] % 2 == 1], tmp_path / "b.jsonl")
    report = ReadReport()
    got = list(iter_records_by_time([tmp_path], report))
    assert len(got) == len(recs) and report.bad == 1
    assert "a.jsonl:4" in str(report.errors[0])


def test_a_file_out_of_order_is_merged_not_sorted(tmp_path):
    """The merge keeps each file's own order (memory stays one record per file)."""
    recs = make_records(steps=6, dp=1, tp=1)
    shuffled = recs[:]
    random.Random(3).shuffle(shuffled)
    write_jsonl(shuffled, tmp_path / "only.jsonl")
    got = list(iter_records_by_time([tmp_path], ReadReport()))
    assert [x["t"] for x in got] == [x["t"] for x in shuffled]


def test_a_sample_trace_merges_every_record():
    trace = SAMPLE_TRACES / "straggler-1.6x"
    merged = list(iter_records_by_time([trace], ReadReport()))
    plain = list(iter_records([trace], ReadReport()))
    assert len(merged) == len(plain)
    ts = [x["t"] for x in merged]
    assert ts == sorted(ts)

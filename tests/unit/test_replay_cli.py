"""Replay, eval and findings on real trace files, through the real command line."""

from __future__ import annotations

import gzip
import random
import subprocess
import sys

import orjson
import pytest
from rankscope.pipeline.cli import main
from rankscope.pipeline.offline.evaluate import evaluate
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import write_jsonl, write_labels, write_parquet
from support.engine_synth import make_records


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A straggler trace as per-rank files with junk lines, a clean one, and a Parquet copy."""
    root = tmp_path_factory.mktemp("traces")
    recs = make_records(steps=40, straggler=(5, 12, 1.3))
    strag = root / "straggler"
    by_rank: dict[int, list] = {}
    for r in recs:
        by_rank.setdefault(r["rank"], []).append(r)
    for rank, rs in by_rank.items():
        write_jsonl(rs, strag / f"rank{rank}.jsonl.gz" if rank % 2 else strag / f"rank{rank}.jsonl")
    with open(strag / "rank0.jsonl", "ab") as fh:
        fh.write(b"{not json\n")
        fh.write(b'{"v": 1, "type": "step", "job": "job-a", "rank": "zero"}\n')
        fh.write(b'{"v": 9, "type": "step", "job": "job-a"}\n')
        fh.write(orjson.dumps(recs[0]) + b"\n")  # a duplicate, valid
    write_labels(strag, [{"kind": "straggler", "ranks": [5], "hosts": ["h1"], "step": 12,
                          "until": None}])  # fmt: skip
    clean = root / "clean"
    write_jsonl(make_records(steps=30, seed=4), clean / "steps.jsonl")
    write_labels(clean, [])
    parquet = root / "parquet"
    write_parquet(recs, parquet)
    return {"straggler": strag, "clean": clean, "parquet": parquet, "records": recs}


def test_replay_reports_malformed_lines_and_keeps_every_valid_record(traces):
    res = replay_trace(traces["straggler"])
    assert res.report.bad == 3
    assert {e.line for e in res.report.errors} == {41, 42, 43}
    assert all(e.file.endswith("rank0.jsonl") for e in res.report.errors)
    reasons = " | ".join(e.reason for e in res.report.errors)
    assert "bad JSON" in reasons and "version" in reasons and "rank" in reasons
    assert sum(res.report.good.values()) == len(traces["records"]) + 1
    stats = res.stats["job-a"]
    assert stats["frames"] == 40 and stats.get("partial_frames", 0) == 0
    (f,) = res.findings
    assert (f.kind, f.ranks, f.hosts, f.first_step) == ("straggler", [5], ["h1"], 12)


def test_shuffled_lines_and_the_parquet_path_give_the_same_findings(traces, tmp_path):
    recs = traces["records"][:]
    random.Random(7).shuffle(recs)
    write_jsonl(recs + recs[:50], tmp_path / "shuffled.jsonl")
    a = replay_trace(tmp_path / "shuffled.jsonl").findings
    b = replay_trace(traces["parquet"]).findings
    c = replay_trace(traces["straggler"]).findings
    key = [(f.finding_id, f.first_step, f.last_step, f.detected_step, f.action) for f in a]
    assert key == [(f.finding_id, f.first_step, f.last_step, f.detected_step, f.action)
                   for f in b] == [(f.finding_id, f.first_step, f.last_step, f.detected_step,
                                    f.action) for f in c]  # fmt: skip


def test_cli_replay_table_and_malformed_summary(traces, capsys):
    assert main(["replay", str(traces["straggler"])]) == 0
    out, err = capsys.readouterr()
    assert "straggler" in out and "h1" in out and "12-39" in out
    assert "3 malformed record(s) skipped" in err
    assert "rank0.jsonl:41: bad JSON" in err


def test_cli_replay_json_stdout_is_only_findings(traces, tmp_path):
    db = tmp_path / "r.duckdb"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "replay", "--json", "--progress", "always",
         "--db", str(db), str(traces["straggler"]), str(traces["clean"])],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1
    f = orjson.loads(lines[0])
    assert f["kind"] == "straggler" and f["ranks"] == [5] and f["action"] in ("evict", "observe")
    assert b"malformed" in proc.stderr
    assert b"] 100% " in proc.stderr  # the progress bar went to stderr, not stdout
    # the stored findings list the same through `rankscope findings`
    cmd = [sys.executable, "-m", "pipeline", "findings", "--db", str(db), "--json"]
    cmd += ["--job", "job-a"]
    proc = subprocess.run(cmd, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (stored,) = [orjson.loads(x) for x in proc.stdout.splitlines()]
    assert stored["finding_id"] == f["finding_id"]


def test_cli_eval_scores_against_labels(traces, capsys):
    args = ["eval", str(traces["straggler"]), str(traces["clean"]), str(traces["parquet"])]
    assert main(args) == 0
    out, _ = capsys.readouterr()
    assert "3 trace(s), 2 labeled" in out
    unlabeled = out.split("findings on unlabeled traces:")[1]
    assert "parquet: straggler ranks [5]" in unlabeled
    row = next(line.split() for line in out.splitlines() if line.startswith("straggler"))
    # kind labels found findings false unattr precision recall f1 lat_med lat_max
    assert row[1:6] == ["1", "1", "1", "0", "0"] and row[6:9] == ["1.00", "1.00", "1.00"]
    assert int(row[10]) <= 3


def test_evaluate_counts_wrong_ranks_as_false_and_missed(tmp_path):
    trace = tmp_path / "t"
    write_jsonl(make_records(steps=30, straggler=(2, 5, 1.4)), trace / "s.jsonl")
    write_labels(trace, [{"kind": "straggler", "ranks": [3], "step": 5, "until": None}])
    ev = evaluate([trace])
    k = ev.kinds["straggler"]
    assert (k.labels, k.found, k.findings, k.true_findings) == (1, 0, 1, 0)
    assert len(ev.missed) == 1 and len(ev.false) == 1


def test_cli_misuse_exits_non_zero_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay"])
    assert exc.value.code == 2
    assert "TRACE" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "nope")]) == 1
    assert "no such trace" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty")]) == 1
    assert "no record files" in capsys.readouterr().err
    assert main(["findings", "--db", str(tmp_path / "absent.duckdb")]) == 1
    assert "no findings store" in capsys.readouterr().err
    bad = tmp_path / "x.txt"
    bad.write_text("hello")
    assert main(["replay", str(bad)]) == 1
    assert "not a trace file" in capsys.readouterr().err
    (tmp_path / "x2.txt").write_text("hello")
    assert main(["replay", str(bad), str(tmp_path / "x2.txt")]) == 1
    assert "none of the given paths is a trace" in capsys.readouterr().err


def test_a_readme_caught_by_a_glob_is_skipped_with_a_warning(traces, capsys):
    readme = traces["clean"].parent / "README.md"
    readme.write_text("# traces")
    assert main(["eval", str(traces["clean"]), str(readme)]) == 0
    out, err = capsys.readouterr()
    assert "skipping" in err and "README.md" in err and "1 trace(s)" in out


def test_truncated_gzip_keeps_the_records_before_the_cut(tmp_path):
    recs = make_records(steps=20)
    path = tmp_path / "t.jsonl.gz"
    write_jsonl(recs, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    res = replay_trace(path)
    assert res.report.bad == 1 and "truncated" in res.report.errors[0].reason
    assert 0 < sum(res.report.good.values()) < len(recs)
    with gzip.open(path, "rb") as fh, pytest.raises(EOFError):
        fh.read()


def test_a_trace_without_step_records_fails_instead_of_reading_clean(tmp_path, capsys):
    """Beats only (a collector that never saw an optimizer step): replay and eval must
    not print "no findings" and exit 0 as if the run were healthy."""
    beats = [{"v": 1, "type": "beat", "job": "j", "rank": r, "host": "h", "t": 1.0 + i,
              "step": 0, "phase": "forward"} for r in range(2) for i in range(5)]  # fmt: skip
    write_jsonl(beats, tmp_path / "beats" / "rank.jsonl")
    write_labels(tmp_path / "beats", [])
    for cmd in ("replay", "eval"):
        assert main([cmd, str(tmp_path / "beats")]) == 1
        err = capsys.readouterr().err
        assert "no step records" in err and "10 beat" in err, err


def test_the_table_shows_an_action_issued_before_the_finding_calmed_down():
    """A finding that evicted and ends as observe says both: the trainer was told."""
    from rankscope.pipeline.cli.tables import FINDING_HEADER, findings_rows, render_table

    base = {"job": "j", "kind": "straggler", "ranks": [3], "hosts": ["node01"], "first_step": 50,
            "last_step": 149, "detected_step": 51, "score": 21.0, "detector": "straggler"}
    calmed = base | {"action": "observe", "evidence": {"actions": {"evict": {"step": 55}}}}
    kept = base | {"action": "evict", "evidence": {"actions": {"recover": {"step": 52},
                                                               "evict": {"step": 57}}}}
    plain = base | {"action": "observe", "evidence": {}}
    rows = findings_rows([calmed, kept, plain])
    col = FINDING_HEADER.index("action")
    assert [r[col] for r in rows] == ["observe (evict sent at 55)", "evict", "observe"]
    assert "observe (evict sent at 55)" in render_table(FINDING_HEADER, rows)

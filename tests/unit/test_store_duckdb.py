"""The DuckDB store: schema and migrations, idempotent writes, triage, parameterized reads."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.store import SCHEMA_VERSION, Store, StoreError
from rankscope.pipeline.traces.files import write_jsonl
from support.engine_synth import make_records


def _finding(job="j", kind="straggler", ranks=(3,), first=10, action="evict", **kw):
    return Finding(job=job, kind=kind, ranks=list(ranks), hosts=["h0"], first_step=first,
                   last_step=first + 5, detected_step=first + 1, detected_t=100.0, score=5.0,
                   detector="straggler", action=action,
                   evidence={"value": 1.5, "actions": {"evict": {"step": first + 6, "t": 101.0}}},
                   **kw)  # fmt: skip


def _dump(store: Store) -> dict:
    out = {}
    for table in ("jobs", "findings", "actions", "scores", "triage", "bad_records"):
        out[table] = sorted(map(repr, store.con.execute(f"SELECT * FROM {table}").fetchall()))  # noqa: S608
    return out


def test_new_store_has_the_schema_and_its_version(tmp_path):
    with Store(tmp_path / "r.duckdb") as s:
        assert s.version() == SCHEMA_VERSION
        assert all(s.count(t) == 0 for t in ("jobs", "findings", "actions", "scores"))
    with Store(tmp_path / "r.duckdb", read_only=True) as s:  # reopening does not migrate again
        assert s.version() == SCHEMA_VERSION


def test_upserts_are_idempotent_and_updates_replace(tmp_path):
    with Store(tmp_path / "r.duckdb") as s:
        f = _finding()
        s.upsert_findings([f])
        s.upsert_findings([f])
        assert s.count("findings") == 1 and s.count("actions") == 1
        f.last_step = 30
        s.upsert_findings([f])
        (row,) = s.list_findings()
        assert row["last_step"] == 30 and row["ranks"] == [3] and row["evidence"]["value"] == 1.5
        cols = {"job": np.array(["j"] * 2, dtype=object), "step": np.array([0, 0]),
                "steps": np.array([1, 1]), "rank": np.array([0, 1]),
                "metric": np.array(["compute_s"] * 2, dtype=object),
                "score": np.array([0.5, 7.0])}  # fmt: skip
        s.upsert_scores(cols)
        s.upsert_scores(cols)
        assert s.count("scores") == 2


def test_replaying_the_same_trace_twice_leaves_the_same_rows(tmp_path):
    trace = tmp_path / "trace"
    write_jsonl(make_records(steps=30, straggler=(3, 8, 1.4)), trace / "steps.jsonl")
    with open(trace / "steps.jsonl", "a") as fh:
        fh.write("not json\n")
    db = tmp_path / "r.duckdb"
    with Store(db) as s:
        replay_trace(trace, store=s)
        first = _dump(s)
    with Store(db) as s:
        replay_trace(trace, store=s)
        second = _dump(s)
    assert first == second
    assert len(first["findings"]) == 1 and len(first["jobs"]) == 1
    assert len(first["scores"]) > 0 and len(first["bad_records"]) == 1


def test_list_findings_filters_by_job_and_kind_with_parameters(tmp_path):
    evil = "x'; DROP TABLE findings; --"
    with Store(tmp_path / "r.duckdb") as s:
        s.upsert_findings([_finding(job="a"), _finding(job=evil, kind="sdc", action="recover")])
        assert [f["job"] for f in s.list_findings(job=evil)] == [evil]
        assert [f["kind"] for f in s.list_findings(kind="straggler")] == ["straggler"]
        assert s.list_findings(job="nobody") == []
        assert len(s.list_findings(limit=1)) == 1
        assert s.count("findings") == 2


def test_triage_is_stored_and_checked(tmp_path):
    with Store(tmp_path / "r.duckdb") as s:
        f = _finding()
        s.upsert_findings([f])
        s.set_triage(f.finding_id, "false_alarm", "noisy neighbour", t=5.0)
        assert s.list_findings()[0]["triage"] == "false_alarm"
        s.set_triage(f.finding_id, "resolved")
        assert s.list_findings()[0]["triage"] == "resolved" and s.count("triage") == 1
        with pytest.raises(ValueError, match="status"):
            s.set_triage(f.finding_id, "maybe")
        s.mark_delivered(f.finding_id, "evict", 9.0)
        assert s.con.execute("SELECT delivered_t FROM actions").fetchone()[0] == 9.0


def test_host_rollup_view(tmp_path):
    with Store(tmp_path / "r.duckdb") as s:
        s.upsert_findings([_finding(ranks=(1,)), _finding(ranks=(2,), kind="sdc",
                                                          action="recover", first=40)])
        (row,) = s.con.execute("SELECT host, findings, action FROM host_rollup").fetchall()
        assert row == ("h0", 2, "evict")


def test_missing_store_newer_schema_and_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(StoreError, match="no findings store"):
        Store(tmp_path / "absent.duckdb", read_only=True)
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "no" / "dir" / "r.duckdb")
    db = tmp_path / "r.duckdb"
    Store(db).close()
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION + 1])
    con.close()
    with pytest.raises(StoreError, match="newer"):
        Store(db)
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        Store(junk)

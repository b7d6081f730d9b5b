"""The dashboard next to a writing `serve`: lock, snapshot, triage retry; and the CLI's checks.

A real second process holds the store open for writing (as `serve` does,
``support/held_store.py``), with rows committed to its WAL but not
checkpointed, while the dashboard reads and writes the same file.
"""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import duckdb
import pytest
from rankscope.dashboard import queries
from rankscope.dashboard.config import DashboardConfig
from rankscope.dashboard.db import StoreUnavailable, open_reader, write_with_retry
from rankscope.pipeline.cli import main as cli_main
from rankscope.pipeline.store import Store
from streamlit.testing.v1 import AppTest
from support.dashboard_store import SDC_JOB
from support.held_store import HeldStore
from support.paths import DASHBOARD_APP

APP = str(DASHBOARD_APP)


@pytest.fixture
def db(built, tmp_path):
    path = tmp_path / "store.duckdb"
    shutil.copy(built[0], path)
    return path


@pytest.fixture
def held(db, tmp_path):
    h = HeldStore(db, tmp_path)
    yield h
    if h.proc.poll() is None:
        h.let_go()


def cfg(db: Path, tmp: Path, **kw) -> DashboardConfig:
    kw.setdefault("open_attempts", 2)
    kw.setdefault("open_backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    return DashboardConfig(db_path=str(db), snapshot_dir=str(tmp / "snaps"), **kw)


def test_locked_store_is_read_from_a_snapshot_that_includes_the_wal(db, tmp_path, held):
    with pytest.raises(duckdb.IOException, match="lock"):
        duckdb.connect(str(db), read_only=True)  # what a naive reader would hit
    with open_reader(cfg(db, tmp_path)) as r:
        assert r.snapshot_t is not None
        assert "live-job" in queries.job_names(r.con)  # committed in the writer's WAL only
    held.let_go()
    with open_reader(cfg(db, tmp_path)) as r:
        assert r.snapshot_t is None and "live-job" in queries.job_names(r.con)


def test_page_says_it_shows_a_snapshot(db, tmp_path, held, monkeypatch):
    monkeypatch.setenv("RANKSCOPE_DB", str(db))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert any("A writer holds the store" in e.proto.body for e in at.sidebar.get("html"))
    assert "live-job" in set(at.dataframe[0].value["job"])


def test_triage_write_waits_for_the_writer_then_lands(db, tmp_path, held):
    with open_reader(cfg(db, tmp_path)) as r:
        fid = queries.job_findings(r.con, SDC_JOB)["finding_id"].iloc[0]
    short = cfg(db, tmp_path, write_attempts=2)
    with pytest.raises(StoreUnavailable, match="not saved") as exc:
        write_with_retry(short, lambda c: queries.set_triage(c, fid, "resolved", "x"))
    assert exc.value.reason == "locked"
    threading.Timer(0.5, held.let_go).start()
    patient = cfg(db, tmp_path, write_attempts=50, max_backoff_s=0.2)
    write_with_retry(patient, lambda c: queries.set_triage(c, fid, "resolved", "node swapped"))
    with open_reader(cfg(db, tmp_path)) as r:
        assert queries.finding(r.con, fid)["triage"] == "resolved"
        assert queries.finding(r.con, fid)["note"] == "node swapped"


def test_failed_write_rolls_back(db, tmp_path):
    c = cfg(db, tmp_path)

    def half_then_fail(con):
        con.execute("DELETE FROM triage")
        con.execute("INSERT INTO triage VALUES ('a', 'resolved', '', 1.0)")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        write_with_retry(c, half_then_fail)
    with open_reader(c) as r:
        assert r.con.execute("SELECT count(*) FROM triage").fetchone()[0] == 0


def test_cli_refuses_missing_old_and_foreign_stores(tmp_path, capsys):
    assert cli_main(["dashboard", "--db", str(tmp_path / "none.duckdb")]) == 1
    err = capsys.readouterr().err
    assert "no findings store at" in err and "Traceback" not in err
    old = tmp_path / "old.duckdb"
    Store(old).close()
    con = duckdb.connect(str(old))
    con.execute("DELETE FROM schema_version")
    con.close()
    assert cli_main(["dashboard", "--db", str(old)]) == 1
    assert "older than" in capsys.readouterr().err
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    assert cli_main(["dashboard", "--db", str(other)]) == 1
    assert "not a rankscope findings store" in capsys.readouterr().err


def test_cli_refuses_a_busy_port_and_a_bad_port(db, capsys):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli_main(["dashboard", "--db", str(db), "--port", str(port)]) == 1
    assert f"port {port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["dashboard", "--db", str(db), "--port", "70000"])
    assert exc.value.code == 2
    assert "port must be 1..65535" in capsys.readouterr().err


def test_cli_store_check_summarises(db, tmp_path, held):
    from rankscope.pipeline.cli.dashboard import check_store

    assert "writing process" in check_store(db)
    held.let_go()
    assert "findings in" in check_store(db)
    empty = tmp_path / "empty.duckdb"
    Store(empty).close()
    assert "empty so far" in check_store(empty)

"""The one read path (``pipeline/store_read.py``) every reader takes, next to a real
second process that holds the store for writing as `serve` does."""

from __future__ import annotations

import json
import tempfile

import pytest
from rankscope.pipeline.cli import main as cli_main
from rankscope.pipeline.store import StoreError
from rankscope.pipeline.store_read import StoreBusy, read_connection, read_store
from support.held_store import HELD_JOB, HeldStore
from support.paths import SAMPLE_TRACES

STRAGGLER = SAMPLE_TRACES / "straggler-1.6x"
FAST = {"attempts": 2, "first_wait_s": 0.01, "max_wait_s": 0.02}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    db = tmp_path_factory.mktemp("store") / "findings.duckdb"
    assert cli_main(["replay", str(STRAGGLER), "--db", str(db)]) == 0
    return db


@pytest.fixture
def held(replayed, tmp_path):
    db = tmp_path / "held.duckdb"
    db.write_bytes(replayed.read_bytes())
    h = HeldStore(db, tmp_path)
    yield db
    if h.proc.poll() is None:
        h.let_go()


def _jobs(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT job FROM jobs").fetchall()}


def test_a_free_store_is_attached_not_copied(replayed):
    with read_store(replayed, **FAST) as store:
        assert store.snapshot_t is None
        assert [f["kind"] for f in store.list_findings()] == ["straggler"]


def test_a_held_store_is_read_from_a_snapshot_with_its_wal(held, tmp_path, monkeypatch):
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with read_connection(held, **FAST) as ro:
        assert ro.snapshot_t is not None
        assert HELD_JOB in _jobs(ro.con)  # committed in the writer's WAL only
        assert list((tmp_path / "tmp").glob("rankscope-read-*"))
    assert not list((tmp_path / "tmp").iterdir())  # the temporary copy is gone
    keep = tmp_path / "snaps"
    with read_connection(held, snapshot_dir=keep, **FAST) as ro:
        first = ro.snapshot_t
    with read_connection(held, snapshot_dir=keep, **FAST) as ro:
        assert ro.snapshot_t == pytest.approx(first, abs=1e-3)  # unchanged store: reused
        assert HELD_JOB in _jobs(ro.con)


def test_missing_and_foreign_files_are_errors_not_busy(tmp_path):
    with pytest.raises(StoreError, match="no findings store"):
        with read_connection(tmp_path / "none.duckdb"):
            pass
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError) as exc:
        with read_connection(junk, **FAST):
            pass
    assert not isinstance(exc.value, StoreBusy)


def test_eval_scores_the_findings_of_a_held_store(held, capsys):
    assert cli_main(["eval", "--db", str(held), str(STRAGGLER), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "snapshot" in err
    scores = json.loads(out)["kinds"]["straggler"]
    assert (scores["labels"], scores["found"], scores["false"]) == (1, 1, 0)
    assert cli_main(["eval", "--db", str(held), str(SAMPLE_TRACES / "network")]) == 0
    out, err = capsys.readouterr()
    assert "'sample-network'" in err and "not in" in err
    assert "missed" in out  # its label is listed as missed, not silently clean

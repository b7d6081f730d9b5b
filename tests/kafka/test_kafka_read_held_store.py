"""Every reader on a store a real `serve` holds for its whole life: the dashboard's
read path (``dashboard/db.py``) and ``rankscope eval --db`` (both through
``pipeline/store_read.py``), without flags and without the raw lock error."""

from __future__ import annotations

import json

import duckdb
import pytest
from rankscope.dashboard import queries
from rankscope.dashboard.config import DashboardConfig
from rankscope.dashboard.db import open_reader
from support.kafka import rankscope, wait_for
from support.paths import SAMPLE_TRACES

pytestmark = pytest.mark.kafka

STRAGGLER = SAMPLE_TRACES / "straggler-1.6x"
CLEAN = SAMPLE_TRACES / "clean-dp8"


def _eval(*args: str) -> tuple[dict, str]:
    p = rankscope("eval", *args, "--json")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out), err


def test_dashboard_and_eval_read_the_store_serve_holds(kafka_url, procs, tmp_path):
    db = tmp_path / "held.duckdb"
    group = kafka_url.rsplit("=", 1)[1] + "-serve"
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--group", group)
    procs.append(serve)
    pub = rankscope("publish", str(STRAGGLER), str(CLEAN), "--bus", kafka_url)
    procs.append(pub)
    assert pub.wait(timeout=60) == 0
    cfg = DashboardConfig(db_path=str(db), snapshot_dir=str(tmp_path / "snaps"))

    def straggler_on_the_page():
        if not db.exists():
            return None
        with open_reader(cfg) as r:
            found = queries.job_findings(r.con, "sample-straggler-1.6x")
            return (r.snapshot_t, found) if len(found) and found["action"].iloc[0] == "evict" \
                else None  # fmt: skip

    snapshot_t, found = wait_for(straggler_on_the_page, 90, "the dashboard to show the evict")
    with pytest.raises(duckdb.IOException, match="lock"):
        duckdb.connect(str(db), read_only=True)  # serve still holds it: a naive reader fails
    assert snapshot_t is not None
    assert list(found["kind"]) == ["straggler"] and list(found["ranks"].iloc[0]) == [5]

    live, err = _eval("--db", str(db), str(STRAGGLER), str(CLEAN))
    assert "snapshot" in err
    replayed, _ = _eval(str(STRAGGLER), str(CLEAN))
    assert live["kinds"]["straggler"] == replayed["kinds"]["straggler"]
    assert live["kinds"]["straggler"]["recall"] == 1.0 and not live["false"]
    assert serve.poll() is None, "serve must still be running (and holding the file)"

    # a trace whose job the store has never seen is said, not scored as clean in silence
    _, err = _eval("--db", str(db), str(SAMPLE_TRACES / "network"))
    assert "not in" in err and "sample-network" in err
    serve.terminate()
    serve.communicate(timeout=60)

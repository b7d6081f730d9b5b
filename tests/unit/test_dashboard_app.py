"""Every dashboard view rendered with Streamlit's AppTest against a replayed store.

The assertions read what the page carries (titles, metrics, tables, the data
behind each chart, messages) and compare it with plain SQL over the same
DuckDB file.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pytest
from rankscope.pipeline.store import Store
from streamlit.testing.v1 import AppTest
from support.dashboard_store import SDC_JOB, SYNTH_JOB
from support.paths import DASHBOARD_APP

APP = str(DASHBOARD_APP)


@pytest.fixture
def db(app_db):
    return app_db  # tests/unit/conftest.py


def render(view: str, **state) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["view"] = view
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def sql(path: Path, query: str, params=()) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(query, list(params)).fetchall()
    finally:
        con.close()


def htmls(at: AppTest) -> list[str]:
    """The page's plain-text blocks (titles, banners, lines), as the browser shows their text."""
    return [html.unescape(re.sub(r"<[^>]+>", " ", e.proto.body)).strip()
            for e in at.get("html")]  # fmt: skip


def banners(at: AppTest) -> list[tuple[str, str]]:
    """(level, text) of each colored banner, in page order."""
    out = []
    for e in at.get("html"):
        m = re.match(r'<div class="rs-banner rs-(\w+)"', e.proto.body)
        if m:
            out.append((m.group(1), html.unescape(re.sub(r"<[^>]+>", " | ", e.proto.body))))
    return out


def page_title(at: AppTest) -> str:
    """The first plain-text title (h1/h2) of the main area."""
    for e in at.get("html"):
        m = re.match(r'<h[12] class="rs-title">(.*)</h[12]>$', e.proto.body)
        if m:
            return html.unescape(m.group(1))
    return ""


# AppTest does not expose a dataframe's key: each table is known by columns only it has.
TABLES = {
    "jobs_table": {"health", "open_findings"}, "open_table": {"steps", "detected", "finding"},
    "top_ranks": {"steps_over", "longest_run", "longest_run_from"},
    "affected": {"findings_on_host"},
    "actions": {"delivered", "at_step"}, "host_ranks": {"rank", "worst_action"},
    "gpu_events": {"event", "detail"}, "triage_log": {"status", "note", "when"},
}  # fmt: skip


def frame(at: AppTest, name: str) -> pd.DataFrame:
    """The one dataframe on the page that is table ``name``."""
    found = [d.value for d in at.dataframe if TABLES[name] <= set(d.value.columns)]
    assert len(found) == 1, f"{len(found)} tables {name!r} on the page"
    return found[0]


def chart_data(at: AppTest, index: int = 0) -> list[pd.DataFrame]:
    """The data sets behind one vega-lite chart on the page."""
    proto = at.get("vega_lite_chart")[index].proto
    return [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in proto.datasets]


def test_jobs_view_shows_health_of_every_job(db, built):
    at = render("Jobs")
    assert at.title[0].value == "Jobs"
    shown = banners(at)
    order = {"error": 0, "warning": 1, "info": 2, "ok": 3}
    assert [order[lv] for lv, _ in shown] == sorted(order[lv] for lv, _ in shown)
    per_job = sql(db, "SELECT sum(least(n, 3)) FROM (SELECT count(*) AS n FROM findings "
                      "GROUP BY job)")[0][0]  # every open finding up to 3 a job has a banner
    assert len([b for b in shown if b[0] != "ok"]) == per_job
    synth = next(t for _, t in shown if t.lstrip(" |").startswith(f"{SYNTH_JOB}:"))
    assert "rank 5 on host gpuhost1" in synth and "EVICT" in synth
    assert "What to do: drain host gpuhost1" in synth and "Open this finding" in synth
    metrics = {m.label: m.value for m in at.metric}
    n_jobs, n_findings = sql(db, "SELECT count(DISTINCT job), count(*) FROM findings")[0]
    assert metrics["Jobs"] == str(len(sql(db, "SELECT job FROM jobs")))
    assert metrics["Open findings"] == str(n_findings)
    jobs = frame(at, "jobs_table")
    assert set(built[1]["jobs"]) <= set(jobs["job"])
    row = jobs.set_index("job").loc[SYNTH_JOB]
    assert "straggler" in row["health"] and row["ranks"] == 8 and row["hosts"] == 2
    last = sql(db, "SELECT last_step FROM jobs WHERE job = ?", [SYNTH_JOB])[0][0]
    assert row["last_step"] == last
    # Worst first (was newest first, which put an observe above two evicts).
    latest = frame(at, "open_table")
    worst = sql(db, "SELECT finding_id FROM findings ORDER BY CASE action WHEN 'evict' THEN 0 "
                    "WHEN 'recover' THEN 1 ELSE 2 END, detected_t DESC, finding_id LIMIT 20")
    assert list(latest["finding"]) == [r[0] for r in worst]


def test_findings_view_filters_and_plots_on_a_step_axis(db):
    at = render("Findings", job=SYNTH_JOB)
    n = sql(db, "SELECT count(*) FROM findings WHERE job = ?", [SYNTH_JOB])[0][0]
    assert page_title(at) == f"Findings of {SYNTH_JOB}"
    assert at.caption[0].value == f"{n} findings match."
    points = chart_data(at)[0]
    # Bars sit at their rank (no offset per kind: a hang on rank 9 was drawn at 9.5).
    assert (points["row"] == points["rank_lo"]).all()
    assert len(points) == n and set(points["kind"]) == {
        r[0] for r in sql(db, "SELECT kind FROM findings WHERE job = ?", [SYNTH_JOB])}
    assert {"first_step", "step_end", "detected_step"} <= set(points)
    assert len(at.dataframe[0].value) == n
    assert at.get("download_button")[0].label.startswith("Export")
    at.multiselect(key="f_kind").set_value(["straggler"]).run()
    table = at.dataframe[0].value
    assert set(table["kind"]) == {"straggler"} and (table["ranks"] == "5").all()
    at.multiselect(key="f_rank").set_value([5]).run()
    assert len(at.dataframe[0].value) == len(table)
    at.multiselect(key="f_triage").set_value(["resolved"]).run()
    assert at.info[0].value == "No findings match these filters."


def test_findings_view_opens_a_finding_detail(db):
    at = render("Findings", job=SDC_JOB)
    fid = sql(db, "SELECT finding_id FROM findings WHERE job = ? AND kind = 'sdc'", [SDC_JOB])[0][0]
    at.selectbox(key="pick_finding").set_value(fid)
    at.button(key="open_detail").click().run()
    assert at.session_state["view"] == "Finding"
    assert page_title(at) == "sdc on ranks 2"
    assert at.query_params["view"] == "Finding" and at.query_params["finding"] == fid


def test_heatmap_view_shows_binned_scores_with_the_straggler_hottest(db):
    at = render("Heatmap", job=SYNTH_JOB)
    assert at.selectbox(key="hm_metric").value == "compute_s"
    cells, onsets = chart_data(at)[:2]
    n_ranks, n_steps = sql(db, "SELECT max(rank) + 1, max(step) + 1 FROM scores WHERE job = ? "
                               "AND metric = 'compute_s'", [SYNTH_JOB])[0]  # fmt: skip
    assert len(cells) == n_ranks * n_steps  # small job: drawn at full resolution
    hot = cells.loc[cells["score"].idxmax()]
    assert hot["rank_lo"] == 5 and hot["step_lo"] >= 20
    # Rows are labelled with their rank (8 rows 0..7, not 9 boundaries 0..8).
    assert sorted(set(cells["row"]), key=int) == [str(r) for r in range(8)]
    # The color scale spans the largest score drawn (it stopped at +-6 while scores reached 50).
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    scale = spec["layer"][0]["encoding"]["color"]["scale"]
    zmax = float(cells["score"].abs().max())
    assert zmax > 50 and scale["domain"] == [-zmax, zmax] and scale["type"] == "symlog"
    assert "8 ranks x 60 steps" in at.caption[0].value
    top = frame(at, "top_ranks")
    assert top["rank"].iloc[0] == 5 and top["steps_over"].iloc[0] >= 35
    starts = sql(db, "SELECT DISTINCT first_step FROM findings WHERE job = ?", [SYNTH_JOB])
    assert set(onsets["rank"]) == {5} and set(onsets["onset_step"]) == {r[0] for r in starts}
    at.slider(key="hm_steps").set_value((0, 19)).run()
    assert at.query_params["steps"] == "0-19"
    early = chart_data(at)[0]
    assert early["step_hi"].max() == 20 and early["score"].max() < 10


def test_heatmap_downsamples_big_jobs_on_the_server(db, monkeypatch):
    con = duckdb.connect(str(db))
    con.execute(
        "INSERT INTO scores SELECT 'wide', s * 4, 4, r, 'compute_s', "
        "CASE WHEN r = 300 AND s >= 50 THEN 9.0 ELSE 0.1 END "
        "FROM range(1024) t(r), range(250) u(s)"
    )
    con.execute("INSERT INTO jobs (job, world, hosts, last_step, frames, last_t, source) "
                "VALUES ('wide', 1024, 128, 999, 1000, 1.0, 'test')")  # named: jobs grew columns
    con.close()
    at = render("Heatmap", job="wide")
    cells = chart_data(at)[0]
    assert len(cells) <= 128 * 200
    assert "1024 ranks x 1000 steps drawn as 128 x 125 cells" in at.caption[0].value
    hot = cells[cells["score"] > 5]
    assert ((hot["rank_lo"] <= 300) & (hot["rank_hi"] > 300)).all() and hot["step_lo"].min() == 200


def test_finding_view_shows_evidence_action_and_hosts(db):
    fid, first, action = sql(
        db, "SELECT finding_id, first_step, action FROM findings "
        "WHERE job = ? AND kind = 'straggler'", [SYNTH_JOB])[0]  # fmt: skip
    at = render("Finding", job=SYNTH_JOB, finding=fid)
    assert page_title(at) == "straggler on ranks 5"
    (level, text), = banners(at)
    assert level == "error" and "rank 5 on host gpuhost1: straggler since step" in text
    assert "1.8x its peers' compute time" in text and "Rank 5 timeline" in text
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["First step"] == str(first) and metrics["Action"] == action
    hosts, acts = frame(at, "affected"), frame(at, "actions")
    assert list(hosts["host"]) == ["gpuhost1"]
    assert list(acts["action"]) == [r[0] for r in sql(
        db, "SELECT action FROM actions WHERE finding_id = ? ORDER BY step", [fid])]
    # A replayed job has no control channel: "not delivered" would be a false alarm.
    assert set(acts["delivered"]) == {"none: no control channel"}
    assert any("has no control channel" in t for t in htmls(at))
    strip = pd.concat(chart_data(at, 0))
    assert {"rank 5", "peers", "peer median"} <= set(strip["who"])
    assert strip.loc[strip["who"] == "rank 5", "value"].iloc[0] > strip.loc[
        strip["who"] == "peers", "value"].max()  # fmt: skip
    history = chart_data(at, 1)
    assert any("rank 5" in set(d.get("rank", pd.Series(dtype=str))) for d in history)


def test_host_view_lists_ranks_and_gpu_health(db):
    at = render("Host", job=SYNTH_JOB, host="gpuhost1")
    assert page_title(at) == "Host gpuhost1"
    ranks = frame(at, "host_ranks")  # every rank the trace puts on the host, not only rank 5
    assert list(ranks["rank"]) == [4, 5, 6, 7] and ranks.set_index("rank").loc[5, "findings"] > 0
    n_gpu_findings = sql(db, "SELECT count(*) FROM findings WHERE job = ? AND kind = 'gpu'",
                         [SYNTH_JOB])[0][0]  # fmt: skip
    if n_gpu_findings:
        events = frame(at, "gpu_events")
        assert "xid" in set(events["event"])
    gpu_metrics = sql(db, "SELECT DISTINCT metric FROM scores WHERE job = ? AND metric LIKE "
                          "'gpu\\_%' ESCAPE '\\' AND rank = 5", [SYNTH_JOB])  # fmt: skip
    titles = [d.proto.spec for d in at.get("vega_lite_chart")]
    for (m,) in gpu_metrics:
        assert any(f"GPU {m[4:]}" in t for t in titles)
    at = render("Host", job=SDC_JOB, host="sdchost0")
    assert "No GPU records for host sdchost0 in this store." in htmls(at)
    at = render("Host", job="sample-gpu-thermal", host="node01")
    events = frame(at, "gpu_events")  # the cause's detail is no longer blank
    assert events["detail"].str.contains("temp_c=85").all()


def test_triage_is_stored_and_shown(db):
    fid = sql(db, "SELECT finding_id FROM findings WHERE job = ?", [SDC_JOB])[0][0]
    at = render("Triage", job=SDC_JOB, finding=fid)
    at.radio(key=f"tri_status_{fid}").set_value("false_alarm")
    at.text_area(key=f"tri_note_{fid}").input("digest bug in the collector, not the GPU")
    at.button(key=f"tri_save_{fid}").click().run()
    assert not at.exception
    assert f"Saved: finding {fid} is false alarm." in htmls(at)
    assert sql(db, "SELECT status, note FROM triage WHERE finding_id = ?", [fid]) == [
        ("false_alarm", "digest bug in the collector, not the GPU")]
    assert frame(at, "triage_log")["status"].iloc[0] == "false_alarm"
    at = render("Findings", job=SDC_JOB, f_triage=["false_alarm"])
    assert list(at.dataframe[0].value["finding"]) == [fid]


def test_missing_store_is_a_message(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKSCOPE_DB", str(tmp_path / "nope.duckdb"))
    at = render("Jobs")
    assert banners(at)[0][0] == "warning" and "No findings store at" in banners(at)[0][1]
    assert not (tmp_path / "nope.duckdb").exists()  # reading never creates the file


def test_empty_store_is_a_message(tmp_path, monkeypatch):
    Store(tmp_path / "empty.duckdb").close()
    monkeypatch.setenv("RANKSCOPE_DB", str(tmp_path / "empty.duckdb"))
    at = render("Heatmap")
    assert any("is empty" in t for t in htmls(at))


def test_older_schema_is_a_message(tmp_path, monkeypatch):
    path = tmp_path / "old.duckdb"
    Store(path).close()
    con = duckdb.connect(str(path))
    con.execute("DELETE FROM schema_version")
    con.close()
    monkeypatch.setenv("RANKSCOPE_DB", str(path))
    at = render("Jobs")
    assert banners(at)[0][0] == "error" and "schema version 0, older than" in banners(at)[0][1]


def test_foreign_duckdb_file_is_a_message(tmp_path, monkeypatch):
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE t (a INTEGER)")
    con.close()
    monkeypatch.setenv("RANKSCOPE_DB", str(path))
    at = render("Jobs")
    assert "not a rankscope findings store" in banners(at)[0][1]
    (tmp_path / "junk.duckdb").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("RANKSCOPE_DB", str(tmp_path / "junk.duckdb"))
    at = render("Jobs")
    msg = banners(at)[0][1]
    assert "not a readable DuckDB database" in msg or "cannot open" in msg


def test_switching_jobs_drops_filters_that_no_longer_apply(db):
    at = render("Findings", job=SYNTH_JOB, f_kind=["straggler"], f_host=["gpuhost1"])
    assert set(at.dataframe[0].value["kind"]) == {"straggler"}
    at.sidebar.selectbox(key="job").set_value(SDC_JOB).run()
    assert not at.exception
    assert at.multiselect(key="f_kind").value == [] and at.multiselect(key="f_host").value == []
    n = sql(db, "SELECT count(*) FROM findings WHERE job = ?", [SDC_JOB])[0][0]
    assert len(at.dataframe[0].value) == n and page_title(at) == f"Findings of {SDC_JOB}"


def test_damaged_store_is_a_message(db):
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE scores")
    con.close()
    at = render("Heatmap", job=SYNTH_JOB)
    (level, msg), = banners(at)
    assert level == "error" and "failed" in msg and "scores" in msg

"""Pages as links and as plain text: deep links, hostile telemetry names, a rank's timeline.

AppTest runs the real app over real DuckDB stores: the replayed demo store,
and a store whose job, host and detector names are hostile Markdown / HTML.
"""

from __future__ import annotations

import html
import json
import re
import shutil

import pytest
from rankscope.dashboard.config import DashboardConfig
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.store import Store
from streamlit.testing.v1 import AppTest
from support.dashboard_store import SDC_JOB, SYNTH_JOB
from support.paths import DASHBOARD_APP

VIEWS = ("Jobs", "Findings", "Heatmap", "Finding", "Rank", "Host", "Triage")
EVIL_URL = "http://127.0.0.1:9/evil.png"
HOSTILE_JOB = f"job![x]({EVIL_URL})**bold**:red[red]"
HOSTILE_HOST = f'<img src="{EVIL_URL}" onerror="alert(1)">node'


@pytest.fixture
def db(app_db):
    return app_db  # tests/unit/conftest.py


def app(**params) -> AppTest:
    at = AppTest.from_file(str(DASHBOARD_APP), default_timeout=60)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(at: AppTest) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", " ", e.proto.body)) for e in at.get("html")]


def title(at: AppTest) -> str:
    for e in at.get("html"):
        m = re.match(r'<h[12] class="rs-title">(.*)</h[12]>$', e.proto.body)
        if m:
            return html.unescape(m.group(1))
    return ""


def test_a_link_opens_the_finding_it_names(db, built):
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    fid = con.execute("SELECT finding_id FROM findings WHERE job = ?", [SDC_JOB]).fetchone()[0]
    con.close()
    at = app(view="Finding", job=SDC_JOB, finding=fid)
    assert at.sidebar.radio(key="view").value == "Finding" and title(at) == "sdc on ranks 2"
    assert at.selectbox(key="finding").value == fid
    # The URL follows navigation: another page, then another job.
    at.sidebar.radio(key="view").set_value("Host").run()
    assert at.query_params["view"] == "Host" and at.query_params["host"] == "sdchost0"
    assert "finding" not in at.query_params
    at.sidebar.selectbox(key="job").set_value(SYNTH_JOB).run()
    assert at.query_params["job"] == SYNTH_JOB


def test_heatmap_and_rank_selections_live_in_the_url(db):
    at = app(view="Heatmap", job=SYNTH_JOB, metric="comm_s", steps="10-30")
    assert at.selectbox(key="hm_metric").value == "comm_s"
    assert at.slider(key="hm_steps").value == (10, 30)
    at.selectbox(key="hm_metric").set_value("compute_s").run()
    assert at.query_params["metric"] == "compute_s"
    at = app(view="Rank", job=SYNTH_JOB, rank="3")
    assert at.selectbox(key="rank").value == 3 and at.query_params["rank"] == "3"
    at = app(view="Findings", job=SYNTH_JOB, kind="straggler")
    assert set(at.dataframe[0].value["kind"]) == {"straggler"}


def test_a_bad_link_falls_back_without_an_error(db):
    at = app(view="Nope", job="no-such-job", finding="zzz", rank="abc", steps="x-y")
    assert at.sidebar.radio(key="view").value == "Jobs"
    assert at.query_params["view"] == "Jobs"


def test_a_rank_timeline_has_its_readings_against_the_peers_in_units(db):
    at = app(view="Rank", job=SYNTH_JOB)  # no rank named: the worst finding's rank
    assert title(at) == f"Rank 5 of {SYNTH_JOB} on host gpuhost1"
    charts = at.get("vega_lite_chart")
    specs = [json.loads(c.proto.spec) for c in charts]
    names = [s["title"] for s in specs]
    assert any("compute_s" in n for n in names) and any("temp_c (°C)" in n for n in names)
    assert any("power_w (W)" in n for n in names) and any("sm_clock_mhz (MHz)" in n for n in names)
    import pyarrow as pa

    def data(i):
        return [pa.ipc.open_stream(d.data.data).read_all().to_pandas()
                for d in charts[i].proto.datasets]  # fmt: skip

    comp = next(d for d in data(names.index(next(n for n in names if "compute_s" in n)))
                if "peer_p90" in d)  # fmt: skip
    late = comp[comp["step"] >= 25]
    assert (late["value"] > late["peer_p90"]).all()  # 1.8x slower than every peer
    early = comp[comp["step"] < 20]
    inside = (early["value"] > early["peer_p10"] * 0.9) & (early["value"] < early["peer_p90"] * 1.1)
    assert inside.all()
    temp = next(d for d in data(names.index(next(n for n in names if "temp_c" in n)))
                if "clock_events" in d)  # fmt: skip
    hot = temp[temp["step"] >= 20]
    assert (hot["value"] >= 88).all() and hot["clock_events"].str.contains("sw_thermal").all()
    assert set(temp[temp["step"] < 20]["clock_events"]) == {"none"}
    spans = [d for i in range(len(charts)) for d in data(i) if "first_step" in d]
    assert spans and set(spans[0]["kind"]) >= {"straggler"}  # the findings are marked
    at.radio(key="tl_axis").set_value("time").run()
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert "when" in json.dumps(spec) and '"temporal"' in json.dumps(spec)


def test_a_job_without_a_trace_shows_scores_against_the_band(db):
    import duckdb

    con = duckdb.connect(str(db))
    con.execute("UPDATE jobs SET source = 'kafka' WHERE job = ?", [SYNTH_JOB])
    con.close()
    at = app(view="Rank", job=SYNTH_JOB, rank="5")
    assert any("No trace of this job's records is at hand" in t for t in texts(at))
    assert len(at.get("vega_lite_chart")) >= 2
    fid = duckdb.connect(str(db), read_only=True).execute(
        "SELECT finding_id FROM findings WHERE job = ? AND kind = 'straggler'", [SYNTH_JOB]
    ).fetchone()[0]
    at = app(view="Finding", job=SYNTH_JOB, finding=fid)  # serve's job: a channel exists
    acts = next(d.value for d in at.dataframe if "delivered" in d.value)
    assert set(acts["delivered"]) == {"not delivered"}


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    path = tmp_path / "hostile.duckdb"
    with Store(path) as store:
        store.record_job({"job": HOSTILE_JOB, "world": 4, "hosts": 1, "last_step": 99,
                          "frames": 100, "last_t": 1.0e9}, source="kafka")  # fmt: skip
        store.con.execute("INSERT INTO scores SELECT ?, s, 1, r, 'compute_s', "
                          "CASE WHEN r = 1 THEN 9.0 ELSE 0.1 END FROM range(4) t(r), "
                          "range(100) u(s)", [HOSTILE_JOB])  # fmt: skip
        store.upsert_findings([Finding(
            job=HOSTILE_JOB, kind="straggler", ranks=[1], hosts=[HOSTILE_HOST], first_step=10,
            last_step=99, detected_step=12, detected_t=1.0e9, score=9.0,
            detector="**det**<script>alert(2)</script>", action="evict",
            evidence={"metric": "compute_s", "value": 0.3, "peer_median": 0.2, "ratio": 1.5,
                      "peers": [0.2, 0.2, 0.21], "note": f"![e]({EVIL_URL})",
                      "actions": {"evict": {"step": 15, "t": 1.0e9}}},
        )])  # fmt: skip
    monkeypatch.setenv("RANKSCOPE_DB", str(path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return path


@pytest.mark.parametrize("view", VIEWS)
def test_hostile_names_are_plain_text_on_every_page(hostile, view):
    at = app(view=view, job=HOSTILE_JOB, host=HOSTILE_HOST)
    markdown = [e.value for kind in ("title", "header", "subheader", "caption", "markdown",
                                     "info", "warning", "error", "success", "table")
                for e in at.get(kind)]  # fmt: skip
    for value in map(str, markdown):  # Markdown-reading elements hold no telemetry text
        assert "evil" not in value and "<img" not in value and "**" not in value
    for e in at.get("html"):  # our HTML holds names only as escaped text
        assert "<img" not in e.proto.body and "<script" not in e.proto.body
    shown = " ".join(texts(at))
    if view in ("Jobs", "Findings", "Heatmap", "Rank", "Triage"):
        assert HOSTILE_JOB in shown  # shown literally, not as an image and bold text
    if view in ("Jobs", "Finding", "Host", "Rank"):
        assert HOSTILE_HOST.replace("<", "") in shown.replace("<", "")


def test_live_refresh_is_on_for_small_stores_and_off_for_big_ones(db, monkeypatch):
    at = app(view="Jobs")
    assert any("Refreshing every 10 s." in e.proto.body for e in at.sidebar.get("html"))
    monkeypatch.setenv("RANKSCOPE_DASHBOARD_REFRESH_S", "0")
    at = app(view="Jobs")
    assert not any("Refreshing" in e.proto.body for e in at.sidebar.get("html"))
    cfg = DashboardConfig(refresh_s=5, live_max_mb=100)
    assert cfg.live_every_s(10_000_000) == 5 and cfg.live_every_s(200_000_000) is None
    assert cfg.live_every_s(None) is None and DashboardConfig(refresh_s=0).live_every_s(1) is None


def test_trace_path_only_where_trace_records_are(tmp_path):
    from rankscope.dashboard.trace_data import trace_path
    from support.paths import SAMPLE_TRACES

    (tmp_path / "bench").mkdir()  # a folder named like a job's source, with no records
    (tmp_path / "bench" / "notes.txt").write_text("not a trace")
    assert trace_path(str(tmp_path / "bench"), tmp_path / "x.duckdb") is None
    assert trace_path("kafka", tmp_path / "x.duckdb") is None and trace_path(None, "x") is None
    sample = SAMPLE_TRACES / "straggler-1.6x"
    assert trace_path(str(sample), tmp_path / "x.duckdb") == sample
    (tmp_path / "trace").mkdir()
    assert trace_path("embedded://demo", tmp_path / "x.duckdb") is None  # empty trace/
    shutil.copy(next(sample.glob("rank*.jsonl.gz")), tmp_path / "trace" / "records.jsonl.gz")
    assert trace_path("embedded://demo", tmp_path / "x.duckdb") == (tmp_path / "trace").resolve()


def test_sdc_and_hang_evidence_are_tables_not_a_collapsed_dict(db):
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    sdc, hang = (con.execute("SELECT finding_id FROM findings WHERE job = ? AND kind = ?",
                             [job, kind]).fetchone()[0]  # fmt: skip
                 for job, kind in ((SDC_JOB, "sdc"), ("sample-hang", "hang")))
    con.close()
    at = app(view="Finding", job=SDC_JOB, finding=sdc)
    votes = next(d.value for d in at.dataframe if "replicas" in d.value)
    assert sorted(votes["replicas"]) == [1, 7]
    assert votes.loc[votes["replicas"] == 1, "ranks"].iloc[0] == "2"  # the diverged replica
    at = app(view="Finding", job="sample-hang", finding=hang)
    waits = next(d.value for d in at.dataframe if "waits for ranks" in d.value)
    assert len(waits) == 7 and set(waits["waits for ranks"]) == {"3"}
    culprit = next(d.value for d in at.dataframe if "why blamed" in d.value)
    assert culprit["op"].iloc[0] == "allreduce" and "never entered" in culprit["why blamed"].iloc[0]

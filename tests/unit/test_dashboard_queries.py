"""The dashboard's query functions against a real store built by replaying traces.

Each answer is checked against an independent reading of the same DuckDB
file (plain SQL or numpy over the raw rows), so a wrong join or a wrong
binning fails here rather than on a page.
"""

from __future__ import annotations

import io
import shutil
import time

import duckdb
import numpy as np
import pandas as pd
import pytest
from rankscope.dashboard import queries as q
from rankscope.dashboard.config import DashboardConfig
from support.dashboard_store import SDC_JOB, SYNTH_JOB, shared_demo_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    db, expected = shared_demo_store(tmp_path_factory)
    return db, expected


@pytest.fixture
def con(store):
    c = duckdb.connect(str(store[0]), read_only=True)
    yield c
    c.close()


@pytest.fixture
def rw_con(store, tmp_path):
    path = tmp_path / "copy.duckdb"
    shutil.copy(store[0], path)
    c = duckdb.connect(str(path))
    yield c
    c.close()


def test_jobs_overview_matches_the_store(con, store):
    jobs = q.jobs_overview(con, now_t=time.time(), recent_s=3600)
    known = con.execute("SELECT job FROM jobs UNION SELECT job FROM findings ORDER BY 1").fetchall()
    assert list(jobs["job"]) == [r[0] for r in known]
    assert set(store[1]["jobs"]) <= set(jobs["job"])
    for row in jobs.itertuples(index=False):
        n, kinds = con.execute(
            "SELECT count(*), list(DISTINCT kind ORDER BY kind) FROM findings WHERE job = ?",
            [row.job],
        ).fetchone()
        assert row.open_findings == n  # nothing triaged yet: every finding is open
        assert (row.health == "healthy") == (n == 0)
        for k in kinds or []:
            assert k in row.health
        world, hosts, last_step = con.execute(
            "SELECT world, hosts, last_step FROM jobs WHERE job = ?", [row.job]
        ).fetchone()
        assert (row.ranks, row.hosts, row.last_step) == (world, hosts, last_step)
    synth = jobs.set_index("job").loc[SYNTH_JOB]
    assert synth.health.startswith("evict:") and "straggler" in synth.health


def test_findings_in_the_last_hour_counts_by_detection_time(con):
    t_max = con.execute("SELECT max(detected_t) FROM findings").fetchone()[0]
    per_job = dict(con.execute(
        "SELECT job, count(*) FROM findings WHERE detected_t >= ? GROUP BY job", [t_max - 60]
    ).fetchall())
    jobs = q.jobs_overview(con, now_t=t_max, recent_s=60).set_index("job")
    for job, n in per_job.items():
        assert jobs.loc[job, "findings_last_hour"] == n
    old = q.jobs_overview(con, now_t=t_max + 10 * 3600, recent_s=3600)
    assert old["findings_last_hour"].sum() == 0


def test_filters_narrow_findings_and_combine(con):
    everything = q.job_findings(con, SYNTH_JOB)
    assert set(everything["kind"]) >= {"straggler"}
    strag = q.job_findings(con, SYNTH_JOB, kinds=["straggler"])
    assert len(strag) >= 1 and set(strag["kind"]) == {"straggler"}
    assert all(5 in r for r in strag["ranks"])
    assert q.job_findings(con, SYNTH_JOB, ranks=[5], hosts=["gpuhost1"]).shape[0] == len(
        [r for r in everything.itertuples() if 5 in r.ranks and "gpuhost1" in r.hosts]
    )
    assert q.job_findings(con, SYNTH_JOB, ranks=[0]).empty  # rank 0 was healthy
    assert q.job_findings(con, SYNTH_JOB, triage=["resolved"]).empty
    assert len(q.job_findings(con, SYNTH_JOB, triage=["open"])) == len(everything)
    opts = q.filter_options(con, SYNTH_JOB)
    assert 5 in opts["rank"] and "gpuhost1" in opts["host"] and "evict" in opts["action"]


def test_user_text_is_a_parameter_never_sql(con):
    hostile = "x' OR '1'='1"
    assert q.job_findings(con, hostile).empty
    assert q.job_findings(con, SYNTH_JOB, kinds=[hostile], hosts=["'; DROP TABLE findings;--"]
                          ).empty  # fmt: skip
    assert q.finding(con, hostile) is None
    assert q.score_metrics(con, hostile) == []
    assert con.execute("SELECT count(*) FROM findings").fetchone()[0] > 0


def test_csv_export_round_trips(con):
    df = q.job_findings(con, SYNTH_JOB)
    back = pd.read_csv(io.BytesIO(q.findings_csv(df)), dtype={"ranks": str})
    assert list(back["finding_id"]) == list(df["finding_id"])
    assert list(back["first_step"]) == list(df["first_step"])
    assert back.loc[0, "ranks"] == " ".join(map(str, df.loc[0, "ranks"]))
    assert {"job", "kind", "hosts", "action", "triage", "evidence", "delivery"} <= set(back)


def test_finding_detail_actions_and_affected_hosts(con):
    fid = q.job_findings(con, SYNTH_JOB, kinds=["straggler"])["finding_id"].iloc[0]
    f = q.finding(con, fid)
    assert f["ranks"] == [5] and f["hosts"] == ["gpuhost1"]
    assert f["evidence"]["metric"] == "compute_s" and f["evidence"]["value"] > f["evidence"][
        "peer_median"]  # fmt: skip
    # A replayed job has no control channel: its decisions were never due for delivery.
    assert q.job_source(con, SYNTH_JOB) != "kafka" and not q.control_channel(con, SYNTH_JOB)
    acts = q.finding_actions(con, fid, channel=q.control_channel(con, SYNTH_JOB))
    stored = con.execute("SELECT action, step FROM actions WHERE finding_id = ? ORDER BY step",
                         [fid]).fetchall()  # fmt: skip
    assert list(zip(acts["action"], acts["at_step"], strict=True)) == stored
    assert set(acts["delivered"]) == {"none: no control channel"}
    assert set(q.finding_actions(con, fid, channel=True)["delivered"]) == {"not delivered"}
    aff = q.affected(con, f)
    assert list(aff["host"]) == ["gpuhost1"] and aff.loc[0, "ranks"] == "5"


def _bucket_rows(con, job, metric):
    return con.execute(
        "SELECT rank, step, score FROM scores WHERE job = ? AND metric = ?", [job, metric]
    ).df()


def test_heatmap_bins_keep_the_largest_magnitude_of_each_cell(con):
    cells, bins = q.heatmap_cells(con, SYNTH_JOB, "compute_s", max_ranks=3, max_steps=7)
    raw = _bucket_rows(con, SYNTH_JOB, "compute_s")
    assert bins.rank_bins <= 3 and bins.step_bins <= 7
    assert bins.ranks == raw["rank"].max() + 1
    for c in cells.itertuples(index=False):
        inside = raw[(raw["rank"] >= c.rank_lo) & (raw["rank"] < c.rank_hi)
                     & (raw["step"] >= c.step_lo) & (raw["step"] < c.step_hi)]  # fmt: skip
        expect = inside["score"].to_numpy()[np.argmax(np.abs(inside["score"].to_numpy()))]
        assert c.score == pytest.approx(expect)
    assert len(cells) == len(cells.drop_duplicates(["rank_lo", "step_lo"]))
    # The straggler's cell after its onset is the hottest of the map.
    hot = cells.loc[cells["score"].idxmax()]
    assert hot.rank_lo <= 5 < hot.rank_hi and hot.step_hi > 20


def test_heatmap_step_range_and_full_resolution(con):
    cells, bins = q.heatmap_cells(con, SYNTH_JOB, "compute_s", max_ranks=64, max_steps=500,
                                  step_lo=30, step_hi=39)  # fmt: skip
    assert bins.steps == 10 and bins.ranks_per_cell == 1 and bins.steps_per_cell == 1
    assert cells["step_lo"].min() == 30 and cells["step_hi"].max() == 40
    assert len(cells) == 8 * 10
    top = q.top_ranks(con, SYNTH_JOB, "compute_s", step_lo=30, step_hi=39, limit=3)
    assert top["rank"].iloc[0] == 5 and top["steps_over"].iloc[0] == 10
    assert top["longest_run_from"].iloc[0] == 30  # clipped to the range asked for


def test_top_ranks_rank_by_persistence_not_by_a_one_step_peak(rw_con):
    """A 90-step straggler at score 5 outranks a one-step spike of 40 (as the issue found)."""
    rw_con.execute(
        "INSERT INTO scores SELECT 'p', s, 1, r, 'compute_s', CASE WHEN r = 3 AND s = 50 THEN 40.0 "
        "WHEN r = 6 AND s >= 10 THEN 5.0 ELSE 0.2 END FROM range(8) t(r), range(100) u(s)")
    top = q.top_ranks(rw_con, "p", "compute_s", step_lo=0, step_hi=99, limit=3)
    assert list(top["rank"][:2]) == [6, 3]
    assert list(top["steps_over"][:2]) == [90, 1] and top["longest_run_from"].iloc[0] == 10
    assert top["longest_run"].iloc[0] == 90
    assert top["peak_score"].iloc[1] == 40.0
    n = rw_con.execute("SELECT count(*) FROM scores WHERE job = 'p' AND rank = 6 AND "
                       "abs(score) >= 3").fetchone()[0]  # fmt: skip
    assert n == 90


def test_score_history_separates_blamed_rank_from_others(con):
    hist = q.score_history(con, SYNTH_JOB, "compute_s", [5], step_lo=10, step_hi=40)
    assert list(hist["step"]) == list(range(10, 41))
    after = hist[hist["step"] >= 22]
    assert (after["rank 5"] > after["peer_p90"]).all()
    assert (hist["peer_p10"] <= hist["peer_median"]).all()


def test_host_view_queries(con):
    assert "gpuhost1" in q.job_hosts(con, SYNTH_JOB)
    ranks = q.host_ranks(con, SYNTH_JOB, "gpuhost1")
    assert list(ranks["rank"]) == [5] and ranks.loc[0, "worst_action"] == "evict"
    placed = q.host_ranks(con, SYNTH_JOB, "gpuhost1", also=[4, 5, 6, 7])
    assert list(placed["rank"]) == [4, 5, 6, 7] and list(placed["findings"]) == [
        0, int(ranks.loc[0, "findings"]), 0, 0]  # fmt: skip
    thermal = q.gpu_events(con, "sample-gpu-thermal", "node01")
    assert len(thermal) and thermal["event"].str.startswith("throttle: sw_thermal").all()
    assert thermal["detail"].str.contains("temp_c=85").all()  # the cause's reading, not blank
    ev = q.gpu_events(con, SYNTH_JOB, "gpuhost1")
    if not ev.empty:  # the GPU detectors name their causes (xid 79 here)
        assert "xid" in set(ev["event"]) and ev["detail"].str.contains("79").any()
    gpu = q.host_gpu(con, SYNTH_JOB, "gpuhost1")
    assert set(gpu["rank"]) <= {5}
    assert q.host_gpu(con, SYNTH_JOB, "no-such-host").empty


def test_triage_set_reopen_and_refuse(rw_con):
    fid = q.job_findings(rw_con, SDC_JOB)["finding_id"].iloc[0]
    q.set_triage(rw_con, fid, "confirmed", "replica diverged; node drained", t=100.0)
    assert q.finding(rw_con, fid)["triage"] == "confirmed"
    log = q.triage_log(rw_con, SDC_JOB)
    assert list(log["finding"]) == [fid] and log.loc[0, "note"].startswith("replica")
    assert q.jobs_overview(rw_con, now_t=0, recent_s=1).set_index("job").loc[
        SDC_JOB, "open_findings"] == len(q.job_findings(rw_con, SDC_JOB))  # confirmed: still open
    q.set_triage(rw_con, fid, "false_alarm", "", t=101.0)
    assert len(q.job_findings(rw_con, SDC_JOB, triage=["false_alarm"])) == 1
    q.set_triage(rw_con, fid, "open")
    assert q.triage_log(rw_con, SDC_JOB).empty
    with pytest.raises(ValueError, match="status"):
        q.set_triage(rw_con, fid, "maybe")
    with pytest.raises(ValueError, match="no finding"):
        q.set_triage(rw_con, "0000000000000000", "resolved")


@pytest.mark.parametrize("bad", [
    {"db_path": ""}, {"open_attempts": 0}, {"write_attempts": 0}, {"open_backoff_s": 0},
    {"open_backoff_s": 1.0, "max_backoff_s": 0.5}, {"heatmap_max_ranks": 1},
    {"heatmap_max_steps": 1}, {"recent_window_s": 0}, {"evidence_window_steps": 0},
    {"max_finding_points": 0}, {"refresh_s": -1}, {"refresh_s": 0.5}, {"live_max_mb": 0},
    {"persist_threshold": 0}, {"timeline_max_steps": 5},
])  # fmt: skip
def test_config_checks(bad):
    with pytest.raises(ValueError):
        DashboardConfig(**bad)


def test_config_reads_db_from_env(monkeypatch):
    monkeypatch.setenv("RANKSCOPE_DB", "/x/y.duckdb")
    assert DashboardConfig.from_env().db_path == "/x/y.duckdb"


def test_config_reads_refresh_from_env(monkeypatch):
    monkeypatch.setenv("RANKSCOPE_DASHBOARD_REFRESH_S", "0")
    assert DashboardConfig.from_env().refresh_s == 0
    monkeypatch.setenv("RANKSCOPE_DASHBOARD_REFRESH_S", "soon")
    with pytest.raises(ValueError, match="number of seconds"):
        DashboardConfig.from_env()


def test_open_findings_worst_action_first_then_newest(con):
    by_job = q.open_by_severity(con, per_job=5)
    assert set(by_job) == set(q.job_names(con)) and by_job["sample-clean-dp8"] == []
    for job, found in by_job.items():
        want = con.execute(
            "SELECT finding_id FROM findings WHERE job = ? ORDER BY CASE action WHEN 'evict' "
            "THEN 0 WHEN 'recover' THEN 1 ELSE 2 END, detected_t DESC, finding_id LIMIT 5",
            [job]).fetchall()  # fmt: skip
        assert [f["finding_id"] for f in found] == [r[0] for r in want]
    latest = q.latest_open_findings(con, limit=50)
    order = {"evict": 0, "recover": 1, "observe": 2}
    assert list(latest["action"].map(order)) == sorted(latest["action"].map(order))
    assert q.job_world(con, SYNTH_JOB) == 8 and q.rank_host(con, SYNTH_JOB, 5) == "gpuhost1"
    assert q.rank_host(con, SYNTH_JOB, 0) is None


def test_jobs_overview_says_what_telemetry_lost(tmp_path):
    from rankscope.pipeline.store import Store

    with Store(tmp_path / "loss.duckdb") as s:
        s.record_job({"job": "lossy", "world": 4, "hosts": 1, "last_step": 9, "frames": 10,
                      "last_t": 1.0, "late": 3, "forced": 0, "partial_frames": 2,
                      "refused": 0, "dropped": 823})  # fmt: skip
        s.record_job({"job": "clean", "world": 4, "hosts": 1, "last_step": 9, "frames": 10,
                      "last_t": 1.0, "late": 0, "forced": 0, "partial_frames": 0,
                      "refused": 0, "dropped": 0})  # fmt: skip
        jobs = q.jobs_overview(s.con, now_t=2.0, recent_s=60).set_index("job")
    assert jobs.loc["lossy", "lost"] == "3 late records, 2 partial steps, 823 dropped by collectors"
    assert jobs.loc["clean", "lost"] == "none"

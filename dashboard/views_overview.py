"""The wide views: every job's health, one job's findings on a step axis, the score heatmap.

Each function draws one page from the read-only connection it is given; the
numbers come from ``dashboard.queries`` and the pictures from
``dashboard.charts``.
"""

from __future__ import annotations

import time

import streamlit as st
from rankscope.dashboard import charts, headline, plain, queries
from rankscope.dashboard.config import DashboardConfig

__all__ = ["show_jobs", "show_findings", "show_heatmap", "open_finding"]

BANNERS_PER_JOB = 3  # open findings of one job with their own banner on the first screen
BANNER_JOBS = 25  # jobs with banners; the jobs table below lists every job
FILTERS = (  # session key, label, option name in queries.filter_options
    ("f_kind", "Kind", "kind"),
    ("f_host", "Host", "host"),
    ("f_rank", "Rank", "rank"),
    ("f_action", "Action", "action"),
    ("f_triage", "Triage status", "triage"),
)


def open_finding(finding_id: str) -> None:
    """Button callback: show one finding's detail page."""
    st.session_state["finding"] = finding_id
    st.session_state["view"] = "Finding"


def _job_banners(job: str, found: list[dict], n_open: int) -> None:
    """One banner per open finding of the job (worst first), then a link to the rest."""
    for f in found[:BANNERS_PER_JOB]:
        b = headline.banner(f)
        links_html = plain.link("Open this finding", view="Finding", job=job,
                                finding=f["finding_id"])  # fmt: skip
        if f["ranks"]:
            links_html += " &middot; " + plain.link(f"Rank {f['ranks'][0]} timeline",
                                                    view="Rank", job=job, rank=f["ranks"][0])
        plain.banner(b.level, [f"{job}: {b.headline}", b.evidence, f"What to do: {b.todo}"],
                     links_html)  # fmt: skip
    if n_open > BANNERS_PER_JOB:
        st.html(plain.link(f"{job}: {n_open - BANNERS_PER_JOB} more open findings",
                           view="Findings", job=job))  # fmt: skip


def show_jobs(con, cfg: DashboardConfig, job: str) -> None:
    st.title("Jobs")
    now = time.time()
    jobs = queries.jobs_overview(con, now_t=now, recent_s=cfg.recent_window_s)
    worst = queries.open_by_severity(con, per_job=BANNERS_PER_JOB)
    n_open = dict(zip(jobs["job"], jobs["open_findings"], strict=True))
    order = sorted(worst, key=lambda j: (
        headline.ACTION_ORDER.get(worst[j][0]["action"], 3) if worst[j] else 9,
        -(worst[j][0]["detected_t"] or 0) if worst[j] else 0, j))  # fmt: skip
    bad = [j for j in order if worst[j]]
    st.subheader(f"{len(bad)} of {len(order)} jobs need attention, worst first"
                 if bad else "Every job looks healthy")  # fmt: skip
    for j in bad[:BANNER_JOBS]:
        _job_banners(j, worst[j], int(n_open.get(j, len(worst[j]))))
    if len(bad) > BANNER_JOBS:
        plain.text(f"{len(bad) - BANNER_JOBS} more jobs need attention: see the jobs table below.")
    healthy = [j for j in order if not worst[j]]
    if healthy:
        plain.banner("ok", [f"Healthy (no open findings): {', '.join(healthy)}"])
    c1, c2, c3 = st.columns(3)
    c1.metric("Jobs", len(jobs))
    c2.metric("Open findings", int(jobs["open_findings"].sum()))
    c3.metric(f"Findings in the last {cfg.recent_window_s / 3600:g} h",
              int(jobs["findings_last_hour"].sum()))
    st.dataframe(jobs, hide_index=True, width="stretch", key="jobs_table")
    st.subheader("Open findings, worst first")
    latest = queries.latest_open_findings(con, limit=20)
    if latest.empty:
        st.success("No open findings: every job looks healthy.")
    else:
        st.dataframe(latest, hide_index=True, width="stretch", key="open_table")


def _filters(con, job: str) -> dict:
    opts = queries.filter_options(con, job)
    cols = st.columns(len(FILTERS))
    chosen = {}
    for col, (key, label, name) in zip(cols, FILTERS, strict=True):
        chosen_before = st.session_state.get(key) or []
        if any(v not in opts[name] for v in chosen_before):  # e.g. after switching jobs
            st.session_state[key] = [v for v in chosen_before if v in opts[name]]
        chosen[name] = col.multiselect(label, opts[name], key=key)
    return chosen


def show_findings(con, cfg: DashboardConfig, job: str) -> None:
    plain.title(f"Findings of {job}")
    chosen = _filters(con, job)
    df = queries.job_findings(
        con, job, kinds=chosen["kind"], hosts=chosen["host"], ranks=chosen["rank"],
        actions=chosen["action"], triage=chosen["triage"],
    )
    st.caption(f"{len(df)} findings match.")
    if df.empty:
        st.info("No findings match these filters.")
        return
    shown = df.head(cfg.max_finding_points)
    st.altair_chart(charts.findings_timeline(shown), width="stretch")
    if len(df) > len(shown):
        st.caption(f"Chart shows the {len(shown)} most recent; the table lists all.")
    st.dataframe(queries.findings_table(df), hide_index=True, width="stretch")
    st.download_button(
        "Export these findings as CSV", queries.findings_csv(df),
        file_name=f"{job}-findings.csv", mime="text/csv", key="csv_findings",
    )
    labels = queries.finding_labels(df)
    pick = st.selectbox("Finding", list(labels), format_func=labels.get, key="pick_finding")
    st.button("Open finding detail", on_click=open_finding, args=(pick,), key="open_detail")


def show_heatmap(con, cfg: DashboardConfig, job: str) -> None:
    plain.title(f"Rank x step scores of {job}")
    metrics = queries.score_metrics(con, job)
    if not metrics:
        st.info("No per-rank scores stored for this job yet.")
        return
    if st.session_state.get("hm_metric") not in metrics:
        st.session_state.pop("hm_metric", None)
    metric = st.selectbox("Metric", metrics, key="hm_metric")
    ext = queries.score_extent(con, job, metric)
    lo, hi = ext.step_lo, ext.step_hi
    if hi > lo:
        rng = st.session_state.get("hm_steps")
        if not rng or rng[0] < lo or rng[1] > hi:
            st.session_state["hm_steps"] = (lo, hi)
        lo, hi = st.slider("Steps", min_value=ext.step_lo, max_value=ext.step_hi, key="hm_steps")
    cells, bins = queries.heatmap_cells(
        con, job, metric, max_ranks=cfg.heatmap_max_ranks, max_steps=cfg.heatmap_max_steps,
        step_lo=lo, step_hi=hi,
    )
    st.caption(
        f"{bins.ranks} ranks x {bins.steps} steps drawn as {bins.rank_bins} x {bins.step_bins} "
        f"cells ({bins.ranks_per_cell} ranks x {bins.steps_per_cell} steps per cell, the cell's "
        "score of largest magnitude; orange: above the peers, blue: below)."
    )
    top = queries.top_ranks(con, job, metric, step_lo=lo, step_hi=hi, limit=10,
                            threshold=cfg.persist_threshold)  # fmt: skip
    onsets = queries.finding_onsets(con, job, step_lo=lo, step_hi=hi)
    st.altair_chart(charts.heatmap(cells, metric, onsets, bins.ranks_per_cell), width="stretch")
    st.subheader("Ranks longest away from their peers")
    st.caption(f"Ranked by the steps with |score| >= {cfg.persist_threshold:g} (persistence), "
               "then the longest unbroken run of them; the score of largest magnitude and its "
               "step. Triangles on the map: the first step of each finding at its ranks.")
    st.dataframe(top, hide_index=True, width="stretch", key="top_ranks")

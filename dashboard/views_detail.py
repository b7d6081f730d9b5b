"""The narrow views: one finding's evidence, one host's ranks and GPUs, and triage.

Triage is the dashboard's only write. It runs in a button callback, which
Streamlit calls before the next render opens its read-only connection, so
this session never holds the file in both modes at once; the write itself is
a short connection with retry (``dashboard.db.write_with_retry``).
"""

from __future__ import annotations

import time

import streamlit as st
from rankscope.dashboard import charts, headline, plain, queries, trace_data
from rankscope.dashboard.config import DashboardConfig
from rankscope.dashboard.db import StoreUnavailable, write_with_retry
from rankscope.dashboard.evidence_tables import evidence_tables
from rankscope.dashboard.views_rank import host_ranks_from_trace

__all__ = ["show_finding", "show_host", "show_triage", "save_triage"]

TRIAGE_LABELS = {
    "open": "open (not triaged)",
    "confirmed": "confirmed",
    "false_alarm": "false alarm",
    "resolved": "resolved",
}


def save_triage(cfg: DashboardConfig, finding_id: str) -> None:
    """Button callback: store the chosen status and note for one finding."""
    status = st.session_state.get(f"tri_status_{finding_id}", "open")
    note = (st.session_state.get(f"tri_note_{finding_id}") or "").strip()
    try:
        write_with_retry(cfg, lambda con: queries.set_triage(con, finding_id, status, note,
                                                             t=time.time()))
    except (StoreUnavailable, ValueError) as exc:
        st.session_state["tri_msg"] = ("error", f"Triage not saved: {exc}")
        return
    st.session_state["tri_msg"] = (
        "success", f"Saved: finding {finding_id} is {TRIAGE_LABELS[status]}."
    )


def _triage_form(cfg: DashboardConfig, f: dict) -> None:
    fid = f["finding_id"]
    msg = st.session_state.pop("tri_msg", None)
    if msg:
        plain.banner("ok" if msg[0] == "success" else "error", [msg[1]])
    key = f"tri_status_{fid}"
    if key not in st.session_state:
        st.session_state[key] = f.get("triage") or "open"
    st.radio("Status", list(TRIAGE_LABELS), format_func=TRIAGE_LABELS.get, key=key,
             horizontal=True)
    nkey = f"tri_note_{fid}"
    if nkey not in st.session_state:
        st.session_state[nkey] = f.get("note") or ""
    st.text_area("Note", key=nkey, max_chars=2000)
    st.button("Save triage", on_click=save_triage, args=(cfg, fid), key=f"tri_save_{fid}")


def _pick_finding(con, job: str) -> dict | None:
    df = queries.job_findings(con, job)
    if df.empty:
        plain.banner("ok", [f"Job {job} has no findings."])
        return None
    labels = queries.finding_labels(df)
    if st.session_state.get("finding") not in labels:
        st.session_state["finding"] = next(iter(labels))
    fid = st.selectbox("Finding", list(labels), format_func=labels.get, key="finding")
    return queries.finding(con, fid)


def show_finding(con, cfg: DashboardConfig, job: str) -> None:
    st.title("Finding")
    f = _pick_finding(con, job)
    if f is None:
        return
    ranks = ", ".join(str(r) for r in f["ranks"]) or "none (unattributed)"
    plain.title(f"{f['kind']} on ranks {ranks}", level=2)
    b = headline.banner(f)
    nav = " &middot; ".join(
        [plain.link(f"Rank {r} timeline", view="Rank", job=job, rank=r) for r in f["ranks"][:4]]
        + [plain.link(f"Host {h}", view="Host", job=job, host=h) for h in f["hosts"][:4]])
    plain.banner(b.level, [b.headline, b.evidence, f"What to do: {b.todo}"], nav)
    c = st.columns(5)
    c[0].metric("Score", f"{f['score']:.2f}" if f["score"] == f["score"] else "n/a")
    c[1].metric("First step", f["first_step"])
    c[2].metric("Last step", f["last_step"])
    c[3].metric("Detected at step", f["detected_step"])
    c[4].metric("Action", f["action"])
    plain.text(f"Detector {f['detector']}; finding id {f['finding_id']}; "
               f"triage: {TRIAGE_LABELS.get(f.get('triage') or 'open')}.", muted=True)
    st.subheader("Affected ranks and hosts")
    st.dataframe(queries.affected(con, f), hide_index=True, width="stretch", key="affected")
    st.subheader("Action issued")
    channel = queries.control_channel(con, job)
    acts = queries.finding_actions(con, f["finding_id"], channel=channel)
    if acts.empty:
        plain.text(f"Policy verdict {f['action']}; no evict or recover message was due.")
    else:
        if not channel:
            plain.text("This job has no control channel (it was replayed from a trace or run "
                       "by the demo): the policy's decisions below were recorded, not sent.")
        st.dataframe(acts, hide_index=True, width="stretch", key="actions")
    st.subheader("Evidence")
    _evidence(con, cfg, job, f)
    st.subheader("Triage")
    _triage_form(cfg, f)


def _evidence(con, cfg: DashboardConfig, job: str, f: dict) -> None:
    ev = f.get("evidence") or {}
    for name, table in evidence_tables(f).items():
        st.caption(name)
        st.dataframe(table, hide_index=True, width="stretch", key=f"ev_{name}")
    label = f"rank {f['ranks'][0]}" if f["ranks"] else "rank"
    strip = charts.evidence_strip(ev, label) if not ev.get("votes") else None
    if strip is not None:
        st.altair_chart(strip, width="stretch")
    metric = ev.get("metric")
    if metric and f["ranks"]:
        hist = queries.score_history(
            con, job, metric, f["ranks"],
            step_lo=f["first_step"] - cfg.evidence_window_steps,
            step_hi=f["last_step"] + cfg.evidence_window_steps // 4,
        )
        if not hist.empty:
            st.altair_chart(charts.score_history(hist, metric, f["first_step"]), width="stretch")
    st.caption("Evidence as stored")
    st.json(ev, expanded=2)


def show_host(con, cfg: DashboardConfig, job: str) -> None:
    path = trace_data.trace_path(queries.job_source(con, job), cfg.db_path)
    placed = host_ranks_from_trace(path, job)
    hosts = sorted(set(queries.job_hosts(con, job)) | set(placed.values()))
    if not hosts:
        st.title("Host")
        plain.text(f"No hosts known for job {job}.")
        return
    if st.session_state.get("host") not in hosts:  # first: the worst open finding's host
        worst = queries.open_by_severity(con, per_job=1).get(job) or [{}]
        first = (worst[0].get("hosts") or [None])[0]
        st.session_state["host"] = first if first in hosts else hosts[0]
    head = st.container()
    host = st.selectbox("Host", hosts, key="host")
    with head:
        plain.title(f"Host {host}")
    st.subheader("Ranks")
    ranks = queries.host_ranks(con, job, host, also=[r for r, h in placed.items() if h == host])
    st.dataframe(ranks, hide_index=True, width="stretch", key="host_ranks")
    if placed:
        plain.text("Ranks placed on hosts by the job's trace; findings counted per rank.",
                   muted=True)  # fmt: skip
    st.subheader("Findings on this host")
    fh = queries.job_findings(con, job, hosts=[host])
    if fh.empty:
        plain.banner("ok", ["No findings on this host."])
    else:
        st.dataframe(queries.findings_table(fh), hide_index=True, width="stretch",
                     key="host_findings")
    st.subheader("GPU health")
    events = queries.gpu_events(con, job, host)
    gpu = queries.host_gpu(con, job, host)
    if events.empty and gpu.empty:
        plain.text(f"No GPU records for host {host} in this store.")
        return
    if not events.empty:
        st.altair_chart(charts.gpu_events(events), width="stretch")
        st.dataframe(events, hide_index=True, width="stretch", key="gpu_events")
    for reading, part in gpu.groupby("reading", sort=True):
        st.altair_chart(charts.gpu_scores(part, reading), width="stretch")


def show_triage(con, cfg: DashboardConfig, job: str) -> None:
    plain.title(f"Triage of {job}")
    f = _pick_finding(con, job)
    if f is None:
        return
    ranks = " ".join(map(str, f["ranks"])) or "none"
    plain.text(f"{f['kind']} on ranks {ranks} (hosts {', '.join(f['hosts'])}), "
               f"steps {f['first_step']}-{f['last_step']}, action {f['action']}.", muted=True)
    _triage_form(cfg, f)
    st.subheader("Triage so far")
    hist = queries.triage_log(con, job)
    if hist.empty:
        st.caption("Nothing triaged yet.")
    else:
        st.dataframe(hist, hide_index=True, width="stretch", key="triage_log")
    all_f = queries.job_findings(con, job)
    st.download_button(
        "Export all findings of this job as CSV", queries.findings_csv(all_f),
        file_name=f"{job}-findings.csv", mime="text/csv", key="csv_triage",
    )

"""rankscope's triage dashboard: the Streamlit entry point (`streamlit run dashboard/app.py`).

Thin on purpose: it reads the configuration, opens a read-only view of the
findings store for this one render (see ``dashboard.db`` for how that works
while `serve` is writing), draws the sidebar and hands the page to one view
function. Every number on a page comes from ``dashboard.queries``.
"""

from __future__ import annotations

import time

import duckdb
import streamlit as st
from rankscope.dashboard import queries
from rankscope.dashboard.config import DashboardConfig
from rankscope.dashboard.db import StoreUnavailable, open_reader
from rankscope.dashboard.views_detail import show_finding, show_host, show_triage
from rankscope.dashboard.views_overview import show_findings, show_heatmap, show_jobs

VIEWS = {
    "Jobs": show_jobs,
    "Findings": show_findings,
    "Heatmap": show_heatmap,
    "Finding": show_finding,
    "Host": show_host,
    "Triage": show_triage,
}


def _seed_from_query_params() -> None:
    """Let a link such as ?view=Finding&job=J&finding=ID open the right page once."""
    if st.session_state.get("_seeded"):
        return
    st.session_state["_seeded"] = True
    qp = st.query_params
    if qp.get("view") in VIEWS:
        st.session_state["view"] = qp["view"]
    for key in ("job", "finding", "host"):
        if qp.get(key):
            st.session_state[key] = qp[key]


def main() -> None:
    st.set_page_config(page_title="rankscope", layout="wide")
    cfg = DashboardConfig.from_env()
    _seed_from_query_params()
    st.sidebar.title("rankscope")
    view = st.sidebar.radio("View", list(VIEWS), key="view")
    try:
        with open_reader(cfg) as reader:
            jobs = queries.job_names(reader.con)
            if not jobs:
                st.title("rankscope")
                st.info(
                    f"The findings store {cfg.db_path} is empty: no job has reported yet. "
                    "Replay a trace into it (`rankscope replay TRACE --db PATH`) or start "
                    "`rankscope serve --db PATH`; this page fills as findings arrive."
                )
                return
            if st.session_state.get("job") not in jobs:
                st.session_state.pop("job", None)
            job = st.sidebar.selectbox("Job", jobs, key="job")
            where = "snapshot" if reader.snapshot_t else "live"
            st.sidebar.caption(f"Store: `{cfg.db_path}` ({where})")
            if reader.snapshot_t:
                age = max(0.0, time.time() - reader.snapshot_t)
                st.sidebar.caption(
                    f"A writer holds the store; showing a copy taken {age:.0f} s ago."
                )
            st.sidebar.button("Refresh")
            VIEWS[view](reader.con, cfg, job)
    except StoreUnavailable as exc:
        st.title("rankscope")
        if exc.reason == "missing":
            st.warning(str(exc))
        else:
            st.error(str(exc))
    except duckdb.Error as exc:  # a damaged file or a store written by a broken writer
        st.error(f"Reading {cfg.db_path} failed: {exc}")


main()

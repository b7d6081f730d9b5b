"""rankscope's triage dashboard: the Streamlit entry point (`streamlit run dashboard/app.py`).

Thin on purpose: it reads the configuration, opens a read-only view of the
findings store for one render (see ``dashboard.db`` for how that works while
`serve` is writing), draws the sidebar and hands the page to one view
function. The page and every selection live in the URL (``dashboard.links``),
so a link pasted in an alert opens that finding. While the store is small
enough the page re-runs itself every ``refresh_s`` (a Streamlit fragment).
"""

from __future__ import annotations

import time
from pathlib import Path

import duckdb
import streamlit as st
from rankscope.dashboard import links, plain, queries
from rankscope.dashboard.config import DashboardConfig
from rankscope.dashboard.db import StoreUnavailable, open_reader
from rankscope.dashboard.views_detail import show_finding, show_host, show_triage
from rankscope.dashboard.views_overview import show_findings, show_heatmap, show_jobs
from rankscope.dashboard.views_rank import show_rank

# Pages with the triage form do not re-run themselves: a re-run would race a person typing.
NO_REFRESH = ("Finding", "Triage")
VIEWS = {
    "Jobs": show_jobs,
    "Findings": show_findings,
    "Heatmap": show_heatmap,
    "Finding": show_finding,
    "Rank": show_rank,
    "Host": show_host,
    "Triage": show_triage,
}


def _problem(cfg: DashboardConfig, exc: Exception) -> None:
    plain.title("rankscope")
    if isinstance(exc, StoreUnavailable):
        plain.banner("warning" if exc.reason == "missing" else "error", [str(exc)])
    else:  # a damaged file or a store written by a broken writer
        plain.banner("error", [f"Reading {cfg.db_path} failed: {exc}"])


def _page(cfg: DashboardConfig, view: str, job: str) -> None:
    """One view over a fresh read-only connection (re-run alone when live)."""
    try:
        with open_reader(cfg) as reader:
            VIEWS[view](reader.con, cfg, job)
            links.write_url(VIEWS)
    except (StoreUnavailable, duckdb.Error) as exc:
        _problem(cfg, exc)


def _live(cfg: DashboardConfig) -> float | None:
    """Seconds between automatic re-runs, or None (off, or the store is too big for it)."""
    try:
        size = Path(cfg.db_path).stat().st_size
    except OSError:
        size = None
    return cfg.live_every_s(size)


def main() -> None:
    st.set_page_config(page_title="rankscope", layout="wide")
    try:
        cfg = DashboardConfig.from_env()
    except ValueError as exc:
        plain.title("rankscope")
        plain.banner("error", [f"Configuration: {exc}"])
        return
    links.seed_from_url(VIEWS)
    st.sidebar.title("rankscope")
    view = st.sidebar.radio("View", list(VIEWS), key="view")
    try:
        with open_reader(cfg) as reader:
            jobs = queries.job_names(reader.con)
            snapshot_t = reader.snapshot_t
    except (StoreUnavailable, duckdb.Error) as exc:
        _problem(cfg, exc)
        return
    if not jobs:
        plain.title("rankscope")
        plain.banner("info", [
            f"The findings store {cfg.db_path} is empty: no job has reported yet.",
            "Replay a trace into it (rankscope replay TRACE --db PATH) or start "
            "rankscope serve --db PATH; this page fills as findings arrive.",
        ])  # fmt: skip
        return
    if st.session_state.get("job") not in jobs:
        st.session_state.pop("job", None)
    job = st.sidebar.selectbox("Job", jobs, key="job")
    with st.sidebar:
        plain.text(f"Store: {cfg.db_path} ({'snapshot' if snapshot_t else 'live'})", muted=True)
        if snapshot_t:
            age = max(0.0, time.time() - snapshot_t)
            plain.text(f"A writer holds the store; showing a copy taken {age:.0f} s ago.",
                       muted=True)  # fmt: skip
        every = _live(cfg) if view not in NO_REFRESH else None
        if every:
            plain.text(f"Refreshing every {every:g} s.", muted=True)
        elif view in NO_REFRESH and cfg.refresh_s:
            plain.text("Auto-refresh paused on this page (it has the triage form).", muted=True)
        elif cfg.refresh_s:
            plain.text(f"Auto-refresh off: the store is over {cfg.live_max_mb:g} MB.", muted=True)
        st.button("Refresh")
    if every:
        st.fragment(run_every=every)(_page)(cfg, view, job)
    else:
        _page(cfg, view, job)


main()

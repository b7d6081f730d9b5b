"""One rank's timeline: its readings against its peers' band, its GPU, its findings.

Raw readings (seconds, °C, W, MHz) come from the job's trace when the store
knows where it is (``dashboard.trace_data``); otherwise, as for a job fed by
``serve``, the page draws the rank's stored consensus scores against the
other ranks' band, which is what the detectors saw.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from rankscope.dashboard import charts, charts_timeline, headline, plain, queries, trace_data
from rankscope.dashboard.config import DashboardConfig

__all__ = ["show_rank", "rank_choices", "host_ranks_from_trace"]

AXES = {"step": "step", "time": "wall time"}


def rank_choices(con, job: str) -> tuple[list[int], int | None]:
    """The job's ranks and the one to show first (its worst open finding's)."""
    world = queries.job_world(con, job)
    worst = queries.open_by_severity(con, per_job=1).get(job) or []
    first = worst[0]["ranks"][0] if worst and worst[0]["ranks"] else None
    return list(range(world)), first


def show_rank(con, cfg: DashboardConfig, job: str) -> None:
    ranks, first = rank_choices(con, job)
    if not ranks:
        plain.title("Rank")
        plain.text(f"No ranks known for job {job}.")
        return
    if st.session_state.get("rank") not in ranks:
        st.session_state["rank"] = first if first in ranks else ranks[0]
    head = st.container()
    c1, c2 = st.columns([1, 2])
    rank = c1.selectbox("Rank", ranks, key="rank")
    axis = c2.radio("X axis", list(AXES), format_func=AXES.get, key="tl_axis", horizontal=True)
    path = trace_data.trace_path(queries.job_source(con, job), cfg.db_path)
    host = (_hosts(str(path), job, _mtime(path)).get(rank) if path else None) or \
        queries.rank_host(con, job, rank)
    with head:
        plain.title(f"Rank {rank} of {job}" + (f" on host {host}" if host else ""))
    mine = queries.job_findings(con, job, ranks=[rank])
    if mine.empty:
        plain.banner("ok", [f"No findings name rank {rank}."])
    else:
        for f in mine.head(3).to_dict("records"):
            b = headline.banner(f)
            plain.banner(b.level, [b.headline, b.evidence, f"What to do: {b.todo}"],
                         plain.link("Open this finding", view="Finding", job=job,
                                    finding=f["finding_id"]))  # fmt: skip
    tl = _timeline(str(path), job, rank, cfg.timeline_max_steps, _mtime(path)) if path else None
    if tl is None or tl.steps.empty:
        _scores_fallback(con, cfg, job, rank, mine)
        return
    plain.text(f"Readings from the trace {path}" + "".join(f"; {n}" for n in tl.notes) + ".",
               muted=True)  # fmt: skip
    spans = charts_timeline.finding_spans(mine, tl.steps)
    st.subheader("Step timings against the peers")
    for metric, part in tl.steps.groupby("metric", sort=False):
        st.altair_chart(charts_timeline.metric_band(part, metric, rank, spans, axis),
                        width="stretch")  # fmt: skip
    st.subheader("GPU")
    if tl.gpu.empty:
        plain.text(f"No GPU records for rank {rank} in the trace.")
        return
    for reading, part in tl.gpu.groupby("reading", sort=False):
        st.altair_chart(charts_timeline.gpu_readings(part, reading, part["unit"].iloc[0], rank,
                                                     spans, axis), width="stretch")  # fmt: skip


def _mtime(path: Path | None) -> float:
    """Part of the cache key: a trace still being written is read again when it changes."""
    try:
        return max((f.stat().st_mtime for f in [path, *path.glob("*")]), default=0.0)
    except (OSError, AttributeError):
        return 0.0


@st.cache_data(max_entries=16, show_spinner=False)
def _timeline(path: str, job: str, rank: int, max_steps: int,
              mtime: float) -> trace_data.RankTimeline:  # fmt: skip
    return trace_data.rank_timeline(Path(path), job, rank, max_steps=max_steps)


@st.cache_data(max_entries=16, show_spinner=False)
def _hosts(path: str, job: str, mtime: float) -> dict[int, str]:
    return trace_data.trace_hosts(Path(path), job)


def host_ranks_from_trace(path: Path | None, job: str) -> dict[int, str]:
    """rank -> host from the job's trace (cached), {} without one."""
    return _hosts(str(path), job, _mtime(path)) if path else {}


def _scores_fallback(con, cfg: DashboardConfig, job: str, rank: int, mine) -> None:
    plain.text("No trace of this job's records is at hand (a job from serve, or a trace that "
               "moved): showing the rank's consensus scores against the other ranks' band "
               "instead of raw readings.", muted=True)  # fmt: skip
    ext = None
    for metric in queries.score_metrics(con, job):
        ext = queries.score_extent(con, job, metric)
        if ext is None:
            continue
        lo = max(ext.step_lo, ext.step_hi - cfg.timeline_max_steps)
        hist = queries.score_history(con, job, metric, [rank], step_lo=lo, step_hi=ext.step_hi)
        if hist.empty:
            continue
        first = int(mine["first_step"].min()) if not mine.empty else lo
        st.altair_chart(charts.score_history(hist, metric, first), width="stretch")

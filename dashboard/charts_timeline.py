"""A rank's timeline charts: its readings against its peers' band, findings shaded.

DataFrame in, chart out (``dashboard.trace_data`` and ``dashboard.queries``
make the frames). The x axis is the step or the wall time (UTC), as the
person picks; findings of the rank are shaded from their first to their last
step (wall-time axis: from the first to the last step's record time).
"""

from __future__ import annotations

import altair as alt
import pandas as pd
from rankscope.dashboard.charts import KIND_COLORS

__all__ = ["metric_band", "gpu_readings", "finding_spans"]

_FIT_X = alt.AutoSizeParams(type="fit-x", contains="padding")
_EVENT_COLORS = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"] * 4
_UNIT = {"step_s": "s", "compute_s": "s", "comm_s": "s", "data_s": "s"}


def _x(axis: str) -> alt.X:
    if axis == "time":
        return alt.X("when:T", title="wall time (UTC)", axis=alt.Axis(format="%H:%M:%S"))
    return alt.X("step:Q", title="step", axis=alt.Axis(format="d"))


def _with_when(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(when=pd.to_datetime(df["t"], unit="s")) if "t" in df else df


def finding_spans(findings: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """first/last step of each finding of the rank, with the record times of those steps."""
    if findings.empty:
        return pd.DataFrame(columns=["kind", "action", "first_step", "last_step", "t0", "t1"])
    t_of = steps.drop_duplicates("step").set_index("step")["t"] if len(steps) else pd.Series()
    out = findings[["kind", "action", "first_step", "last_step"]].copy()
    out["t0"] = out["first_step"].map(t_of)
    out["t1"] = out["last_step"].map(t_of)
    return out


def _spans(spans: pd.DataFrame, axis: str) -> alt.Chart | None:
    if spans is None or spans.empty:
        return None
    if axis == "time":
        s = spans.dropna(subset=["t0", "t1"])
        if s.empty:
            return None
        s = s.assign(a=pd.to_datetime(s["t0"], unit="s"), b=pd.to_datetime(s["t1"], unit="s"))
        x, x2 = alt.X("a:T"), alt.X2("b:T")
    else:
        s = spans.assign(a=spans["first_step"], b=spans["last_step"] + 1)
        x, x2 = alt.X("a:Q"), alt.X2("b:Q")
    kinds = sorted(set(s["kind"]))
    return alt.Chart(s).mark_rect(opacity=0.12).encode(
        x=x, x2=x2,
        color=alt.Color("kind:N", title="finding", scale=alt.Scale(
            domain=kinds, range=[KIND_COLORS.get(k, "#888888") for k in kinds])),
        tooltip=["kind:N", "action:N", "first_step:Q", "last_step:Q"],
    )  # fmt: skip


def metric_band(df: pd.DataFrame, metric: str, rank: int, spans: pd.DataFrame | None = None,
                axis: str = "step") -> alt.LayerChart:  # fmt: skip
    """One metric of the rank (red line) against its peers' p10-p90 band and median."""
    d = _with_when(df)
    unit = _UNIT.get(metric, "score")
    x = _x(axis)
    band = alt.Chart(d).mark_area(opacity=0.3, color="#999999").encode(
        x=x, y=alt.Y("peer_p10:Q", title=f"{metric} ({unit})"), y2="peer_p90:Q")
    med = alt.Chart(d).mark_line(color="#666666", strokeDash=[4, 3]).encode(
        x=x, y="peer_median:Q")
    mine = alt.Chart(d).mark_line(color="#d62728", strokeWidth=2).encode(
        x=x, y="value:Q",
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("value:Q", format=".4g", title=f"rank {rank}"),
                 alt.Tooltip("peer_median:Q", format=".4g", title="peer median")],
    )  # fmt: skip
    layers = [c for c in (_spans(spans, axis), band, med, mine) if c is not None]
    return alt.layer(*layers).resolve_scale(color="independent").properties(
        height=170, autosize=_FIT_X,
        title=f"rank {rank} {metric} (red) vs peers (grey band p10-p90, dashed median)",
    )


def gpu_readings(df: pd.DataFrame, reading: str, unit: str, rank: int,
                 spans: pd.DataFrame | None = None, axis: str = "step") -> alt.LayerChart:
    """One GPU reading of the rank in its unit; points colored by the throttle reasons."""
    d = _with_when(df)
    x = _x(axis)
    line = alt.Chart(d).mark_line(color="#4c78a8").encode(
        x=x, y=alt.Y("value:Q", title=f"{reading} ({unit})", scale=alt.Scale(zero=False)))
    events = ["none", *sorted(set(d["clock_events"]) - {"none"})]
    pts = alt.Chart(d).mark_point(filled=True, size=30).encode(
        x=x, y="value:Q",
        color=alt.Color("clock_events:N", title="throttle reasons", scale=alt.Scale(
            domain=events, range=["#9e9e9e", *_EVENT_COLORS][:len(events)])),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("value:Q", format=".4g", title=unit),
                 alt.Tooltip("clock_events:N", title="throttle reasons")],
    )  # fmt: skip
    layers = [c for c in (_spans(spans, axis), line, pts) if c is not None]
    return alt.layer(*layers).resolve_scale(color="independent").properties(
        height=150, autosize=_FIT_X, title=f"rank {rank} GPU {reading} ({unit})")

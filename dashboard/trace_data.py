"""Raw readings for a rank's timeline and a host's ranks, read from the job's trace.

The store (schema version 1) keeps findings and bucketed scores, not the
records themselves, so a rank's compute time in seconds or its GPU's
temperature in °C over wall time comes from the trace the store was filled
from: ``jobs.source`` of a replayed job names it, and the demo keeps its
stream in ``trace/`` beside its store. Records go through the pipeline's one
validating reader (``pipeline.traces.files``); malformed lines are counted
there and skipped. A job from ``serve`` has no trace: callers fall back to
the scores. Pure functions, no Streamlit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from rankscope.pipeline.traces.files import ReadReport, iter_records, read_meta, trace_files

__all__ = ["STEP_METRICS", "GPU_READINGS", "RankTimeline", "trace_path", "rank_timeline",
           "trace_hosts"]  # fmt: skip

STEP_METRICS = ("compute_s", "comm_s", "data_s", "step_s")  # seconds, as the trace names them
GPU_READINGS = {"temp_c": "°C", "power_w": "W", "sm_clock_mhz": "MHz"}


@dataclass(slots=True)
class RankTimeline:
    """A rank's step metrics against its peers' band, and its GPU's readings."""

    steps: pd.DataFrame  # step, t, metric, value, peer_p10, peer_median, peer_p90
    gpu: pd.DataFrame  # t, step, reading, value, unit, clock_events
    bad_records: int = 0
    notes: list[str] = field(default_factory=list)


def trace_path(source: str | None, db_path: str | Path) -> Path | None:
    """Where a job's trace lies: its replayed path, or the demo's ``trace/`` beside the store.

    Only a path that holds trace record files counts (a source such as
    ``bench`` must not pick up a folder of that name).
    """
    if not source or source == "kafka":
        return None
    p = Path(db_path).resolve().parent / "trace" if source.startswith("embedded://") \
        else Path(source)
    try:
        return p if trace_files(p) else None
    except (OSError, ValueError):  # missing, or not a trace file
        return None


def trace_hosts(path: Path, job: str) -> dict[int, str]:
    """rank -> host of a trace: meta.json's ``hosts``, else the step records' ``host``."""
    meta = read_meta(path) or {}
    hosts = meta.get("hosts")
    if isinstance(hosts, dict) and (meta.get("job") in (None, job)):
        return {int(r): str(h) for r, h in hosts.items() if str(r).isdigit()}
    out: dict[int, str] = {}
    for rec in iter_records([path], ReadReport()):
        if rec.get("type") == "step" and rec.get("job") == job and rec.get("host"):
            out.setdefault(int(rec["rank"]), str(rec["host"]))
    return out


def rank_timeline(path: Path, job: str, rank: int, *, max_steps: int) -> RankTimeline:
    """The rank's step metrics (s) with its peers' p10 / median / p90, and its GPU readings.

    At most the last ``max_steps`` steps are kept, so a long trace stays cheap to draw.
    """
    report = ReadReport()
    step_rows: list[tuple] = []
    gpu_rows: list[dict] = []
    for rec in iter_records([path], report):
        if rec.get("job") != job:
            continue
        kind = rec.get("type")
        if kind == "step":
            step_rows.append((int(rec["rank"]), int(rec["step"]), float(rec["t"]),
                              *(_num(rec.get(m)) for m in STEP_METRICS)))  # fmt: skip
        elif kind == "gpu" and rec.get("rank") == rank:
            gpu_rows.append(rec)
    tl = RankTimeline(_steps(step_rows, rank, max_steps), pd.DataFrame(), report.bad)
    tl.gpu = _gpu(gpu_rows, tl.steps)
    if report.bad:
        tl.notes.append(f"{report.bad} malformed records in the trace were skipped")
    return tl


def _num(v) -> float:
    try:
        return float(v) if v is not None else np.nan
    except (TypeError, ValueError):
        return np.nan


def _steps(rows: list[tuple], rank: int, max_steps: int) -> pd.DataFrame:
    cols = ["step", "t", "metric", "value", "peer_p10", "peer_median", "peer_p90"]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows, columns=["rank", "step", "t", *STEP_METRICS])
    df = df.drop_duplicates(["rank", "step"], keep="last")
    last = int(df["step"].max())
    df = df[df["step"] > last - max_steps]
    mine = df[df["rank"] == rank].set_index("step").sort_index()
    peers = df[df["rank"] != rank]
    out = []
    for m in STEP_METRICS:
        q = peers.groupby("step")[m].quantile([0.1, 0.5, 0.9]).unstack()
        part = pd.DataFrame({"step": mine.index, "t": mine["t"].to_numpy(), "metric": m,
                             "value": mine[m].to_numpy()})  # fmt: skip
        if not q.empty:
            q.columns = ["peer_p10", "peer_median", "peer_p90"]
            part = part.merge(q.reset_index(), on="step", how="left")
        else:
            part = part.assign(peer_p10=np.nan, peer_median=np.nan, peer_p90=np.nan)
        out.append(part)
    return pd.concat(out, ignore_index=True)[cols]  # metrics in STEP_METRICS order, steps sorted


def _gpu(rows: list[dict], steps: pd.DataFrame) -> pd.DataFrame:
    cols = ["t", "step", "reading", "value", "unit", "clock_events"]
    if not rows:
        return pd.DataFrame(columns=cols)
    t = np.array([float(r["t"]) for r in rows])
    own = steps[steps["metric"] == STEP_METRICS[0]].sort_values("t")
    if len(own):  # the step in progress at each sample: the last step record at or before it
        idx = np.searchsorted(own["t"].to_numpy(), t, side="right") - 1
        step = own["step"].to_numpy()[np.clip(idx, 0, len(own) - 1)]
    else:
        step = np.full(len(rows), -1)
    out = []
    for i, r in enumerate(rows):
        events = ", ".join(str(e) for e in r.get("clock_events") or []) or "none"
        for reading, unit in GPU_READINGS.items():
            out.append({"t": t[i], "step": int(step[i]), "reading": reading,
                        "value": _num(r.get(reading)), "unit": unit, "clock_events": events})
    return pd.DataFrame(out, columns=cols)

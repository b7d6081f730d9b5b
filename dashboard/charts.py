"""Altair charts of the dashboard, built from the DataFrames of ``dashboard.queries``.

Pure functions (DataFrame in, chart out) so the Streamlit layer stays thin
and a test can check a chart's encoding without a browser. Colors of fault
kinds are fixed so a straggler is the same color on every page.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
from rankscope.collectors.schema.records import LABEL_KINDS

__all__ = [
    "KIND_COLORS",
    "findings_timeline",
    "heatmap",
    "evidence_strip",
    "score_history",
    "gpu_scores",
    "gpu_events",
]

KIND_COLORS = {
    "straggler": "#e45756",
    "network": "#f58518",
    "sdc": "#b279a2",
    "nonfinite": "#000000",
    "hang": "#4c78a8",
    "crash": "#9d755d",
    "gpu": "#54a24b",
}
# Fit the container's width, keep the height asked for: Streamlit's default
# ("fit" including padding) squeezes short charts to a sliver.
_FIT_X = alt.AutoSizeParams(type="fit-x", contains="padding")
MAX_BAND_ROWS = 40  # ranks with findings up to which each gets its own labelled row
_KIND_SCALE = alt.Scale(domain=list(LABEL_KINDS), range=[KIND_COLORS[k] for k in LABEL_KINDS])


def findings_timeline(df: pd.DataFrame) -> alt.Chart:
    """One bar per finding from its first to its last step, at its lowest rank, colored by kind.

    A dot marks the step it was detected. Expects the columns of
    ``queries.job_findings``.
    """
    data = df.assign(
        step_end=df["last_step"] + 1,
        rank_lo=df["ranks"].map(lambda r: min(r) if len(r) else -1),
        # At the rank itself: an offset per kind drew a hang on rank 9 at 9.5.
        row=df["ranks"].map(lambda r: min(r) if len(r) else -1),
        ranks_text=df["ranks"].map(lambda r: ",".join(str(x) for x in r[:16])),
        hosts_text=df["hosts"].map(lambda h: ",".join(h[:8])),
    )[
        [
            "finding_id", "kind", "first_step", "step_end", "detected_step", "rank_lo", "row",
            "ranks_text", "hosts_text", "action", "triage", "score",
        ]
    ]
    tooltip = [
        alt.Tooltip("finding_id:N", title="finding"),
        alt.Tooltip("kind:N"),
        alt.Tooltip("ranks_text:N", title="ranks"),
        alt.Tooltip("hosts_text:N", title="hosts"),
        alt.Tooltip("first_step:Q", title="first step"),
        alt.Tooltip("detected_step:Q", title="detected at"),
        alt.Tooltip("action:N"),
        alt.Tooltip("triage:N"),
        alt.Tooltip("score:Q", format=".2f"),
    ]
    base = alt.Chart(data)
    rows = sorted(set(int(r) for r in data["row"]))
    if len(rows) <= MAX_BAND_ROWS:
        # One labelled row per rank; findings of several kinds on a rank share its row,
        # side by side inside it (the label stays the rank's own, at the row's middle).
        y = alt.Y("row:O", title="rank (lowest affected)", sort=rows)
        kinds = set(data["kind"])
        present = [k for k in LABEL_KINDS if k in kinds] + sorted(kinds - set(LABEL_KINDS))
        split = {"yOffset": alt.YOffset("kind:N", scale=alt.Scale(domain=present))}
        bar = base.mark_bar(opacity=0.85)
    else:  # too many ranks for a row each: a rank axis, bars at their rank exactly
        y = alt.Y("row:Q", title="rank (lowest affected)", axis=alt.Axis(format="d"),
                  scale=alt.Scale(domain=[rows[0] - 1, rows[-1] + 1], nice=False))
        split = {}
        bar = base.mark_bar(height=6, opacity=0.75)
    bars = bar.encode(
        x=alt.X("first_step:Q", title="step"), x2="step_end:Q", y=y,
        color=alt.Color("kind:N", scale=_KIND_SCALE, title="kind"), tooltip=tooltip, **split,
    )  # fmt: skip
    dots = base.mark_point(filled=True, size=70, stroke="black", strokeWidth=1).encode(
        x="detected_step:Q", y=y,
        color=alt.Color("kind:N", scale=_KIND_SCALE, title="kind"),
        shape=alt.Shape("action:N", title="action"), tooltip=tooltip, **split,
    )  # fmt: skip
    return (bars + dots).properties(height=320, title="Findings by step", autosize=_FIT_X)


def heatmap(cells: pd.DataFrame, metric: str, onsets: pd.DataFrame | None = None,
            ranks_per_cell: int = 1) -> alt.LayerChart:
    """Rank x step cells of consensus scores; orange above the peers, blue below.

    ``cells`` has rank_lo, rank_hi, step_lo, step_hi (exclusive ends) and the
    signed score of largest magnitude in each cell (``queries.heatmap_cells``),
    already binned on the server. Each row is labelled with its rank (or its
    ranks' range when binned), in the middle of the row. The color scale is
    symmetric-log and spans the largest |score| drawn, so a 50 and a 5 are
    both visible. ``onsets`` (rank, onset_step, kind: the findings' first
    steps at the ranks they name) are marked with a triangle.
    """
    end = int(cells["rank_hi"].max()) if len(cells) else 0
    los = sorted(set(map(int, cells["rank_lo"])))
    labels = {r: _row_label(r, ranks_per_cell, end) for r in los}
    data = cells.assign(row=cells["rank_lo"].map(lambda r: labels[int(r)]))
    zmax = max(3.0, float(cells["score"].abs().max())) if len(cells) else 3.0
    order = list(labels.values())
    xs = alt.Undefined
    if len(cells):  # the axis ends where the job ends, not at the next round number
        xs = [int(cells["step_lo"].min()), int(cells["step_hi"].max())]
    y = alt.Y("row:O", title="rank" if ranks_per_cell == 1 else "ranks", sort=order,
              axis=alt.Axis(labelOverlap="parity"))  # fmt: skip
    rect = alt.Chart(data).mark_rect().encode(
        x=alt.X("step_lo:Q", title="step", scale=alt.Scale(domain=xs, nice=False)),
        x2="step_hi:Q",
        y=y,
        color=alt.Color(
            "score:Q",
            title=f"{metric} score",
            scale=alt.Scale(type="symlog", scheme="blueorange", domainMid=0,
                            domain=[-zmax, zmax]),  # fmt: skip
        ),
        tooltip=[
            alt.Tooltip("row:N", title="rank" if ranks_per_cell == 1 else "ranks"),
            alt.Tooltip("step_lo:Q", title="steps from"),
            alt.Tooltip("step_hi:Q", title="steps to (excl.)"),
            alt.Tooltip("score:Q", format=".2f", title="score"),
        ],
    )
    layers = [rect]
    if onsets is not None and len(onsets) and len(cells):
        o = onsets.dropna(subset=["onset_step"])
        o = o.assign(row=o["rank"].map(
            lambda r: _row_label(int(r) // ranks_per_cell * ranks_per_cell, ranks_per_cell, end)))
        layers.append(alt.Chart(o).mark_point(shape="triangle-right", filled=True, size=90,
                                              color="black").encode(
            x="onset_step:Q", y=y,
            tooltip=[alt.Tooltip("rank:Q"), alt.Tooltip("onset_step:Q", title="onset step"),
                     alt.Tooltip("kind:N", title="finding")],
        ))  # fmt: skip
    return alt.layer(*layers).properties(
        height=420, title=f"Consensus score: {metric} (triangles: where findings start)",
        autosize=_FIT_X)


def _row_label(rank_lo: int, per_cell: int, rank_end: int) -> str:
    if per_cell == 1:
        return str(int(rank_lo))
    return f"{int(rank_lo)}-{min(rank_lo + per_cell, rank_end) - 1}"


def evidence_strip(evidence: dict, rank_label: str) -> alt.Chart | None:
    """The rank's value against each peer's, the peer median and its own history median.

    One row per kind of value on a shared x axis, so a straggler's tick sits
    visibly apart from the cluster of its peers.
    """
    rows = [{"who": "peers", "value": v} for v in map(_num, evidence.get("peers") or [])
            if v is not None]  # fmt: skip
    for key, label in (("value", rank_label), ("peer_median", "peer median"),
                       ("history_median", "own history median")):  # fmt: skip
        v = _num(evidence.get(key))
        if v is not None:
            rows.append({"who": label, "value": v})
    if not any(r["who"] == rank_label for r in rows) and not any(r["who"] == "peers" for r in rows):
        return None
    order = [rank_label, "peers", "peer median", "own history median"]
    return alt.Chart(pd.DataFrame(rows)).mark_tick(thickness=3, size=22).encode(
        x=alt.X("value:Q", title=str(evidence.get("metric") or "value"),
                scale=alt.Scale(zero=False)),
        y=alt.Y("who:N", title=None, sort=order),
        color=alt.Color(
            "who:N",
            scale=alt.Scale(domain=order, range=["#e45756", "#999999", "#4c78a8", "#54a24b"]),
            legend=None,
        ),
        tooltip=["who:N", alt.Tooltip("value:Q", format=".4g")],
    ).properties(height=alt.Step(30), title="Evidence at detection", autosize=_FIT_X)


def score_history(df: pd.DataFrame, metric: str, first_step: int) -> alt.LayerChart:
    """The blamed ranks' scores over steps against the band of their peers (p10-p90, median)."""
    band = alt.Chart(df).mark_area(opacity=0.25, color="#999999").encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("peer_p10:Q", title=f"{metric} score"),
        y2="peer_p90:Q",
    )
    med = alt.Chart(df).mark_line(color="#666666", strokeDash=[4, 3]).encode(
        x="step:Q", y="peer_median:Q"
    )
    long = df.melt(id_vars=["step"], value_vars=[c for c in df.columns if c.startswith("rank ")],
                   var_name="rank", value_name="score")
    lines = alt.Chart(long).mark_line(point=True).encode(
        x="step:Q", y="score:Q", color=alt.Color("rank:N", title="blamed rank"),
        tooltip=["rank:N", "step:Q", alt.Tooltip("score:Q", format=".3g")],
    )
    onset = alt.Chart(pd.DataFrame({"step": [first_step]})).mark_rule(color="#e45756").encode(
        x="step:Q"
    )
    return (band + med + lines + onset).properties(
        height=220, autosize=_FIT_X,
        title=f"{metric}: blamed ranks vs peers (grey band p10-p90, dashed median)",
    )


def gpu_scores(df: pd.DataFrame, reading: str) -> alt.Chart:
    """One line per rank of a host over steps: how far its GPU's reading sat from its peers'."""
    return alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"),
        y=alt.Y("score:Q", title=f"{reading} score vs peers"),
        color=alt.Color("rank:N", title="rank"),
        tooltip=["rank:N", "step:Q", alt.Tooltip("score:Q", format=".3g")],
    ).properties(height=180, title=f"GPU {reading}", autosize=_FIT_X)


def gpu_events(df: pd.DataFrame) -> alt.Chart:
    """XIDs, ECC errors, temperature and throttle causes of GPU findings on a step axis."""
    return alt.Chart(df).mark_point(filled=True, size=90).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1)),
        y=alt.Y("event:N", title=None, axis=alt.Axis(labelLimit=320)),
        color=alt.Color("event:N", legend=None),
        tooltip=["step:Q", "gpu:N", "ranks:N", "event:N", "detail:N", "action:N"],
    ).properties(height=140, title="GPU events", autosize=_FIT_X)


def _num(v) -> float | None:
    if v is None or isinstance(v, str):  # "nan"/"inf" strings: not plottable as a number
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None

"""Every question the dashboard asks the findings store, as plain functions.

Each takes an open DuckDB connection (read-only, from ``dashboard.db``) and
returns a DataFrame, a dict or a list, so tests and scripts call them without
Streamlit. Every value that comes from a person (job, filters, finding id,
metric, step range, a triage note) is a query parameter; no SQL text is ever
built from input. Tables and columns are the engine's store schema
(pipeline/store.py, version 1). The rank x step heatmap lives in
``dashboard.queries_scores`` and is re-exported here.
"""

from __future__ import annotations

import math
import time

import orjson
import pandas as pd
from rankscope.dashboard.queries_scores import (
    HeatmapBins,
    ScoreExtent,
    gpu_events,
    heatmap_cells,
    host_gpu,
    score_extent,
    score_history,
    score_metrics,
    top_ranks,
)
from rankscope.pipeline.store import TRIAGE_CHOICES, write_triage

__all__ = [
    "TRIAGE_CHOICES", "HeatmapBins", "ScoreExtent", "job_names", "jobs_overview",
    "latest_open_findings", "filter_options", "job_findings", "findings_table", "findings_csv",
    "finding_labels", "finding", "affected", "finding_actions", "job_hosts", "host_ranks",
    "set_triage", "triage_log", "score_metrics", "score_extent", "heatmap_cells", "top_ranks",
    "score_history", "host_gpu", "gpu_events", "open_by_severity", "control_channel",
    "job_world", "job_source", "rank_host", "finding_onsets",
]  # fmt: skip

# Findings a person still has to act on are those not triaged away: the SQL
# below says so as ``coalesce(t.status, 'open') IN ('open', 'confirmed')``.


def _df(con, sql: str, params: list | None = None) -> pd.DataFrame:
    return con.execute(sql, params or []).df()


def _when(t) -> str:
    if t is None or (isinstance(t, float) and not math.isfinite(t)):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t))) + " UTC"


def job_names(con) -> list[str]:
    """Jobs known to the store (from the jobs table and from findings), sorted."""
    rows = con.execute(
        "SELECT job FROM jobs UNION SELECT DISTINCT job FROM findings ORDER BY job"
    ).fetchall()
    return [r[0] for r in rows]


def jobs_overview(con, *, now_t: float, recent_s: float) -> pd.DataFrame:
    """One row per job: health (open findings by kind), last step seen, ranks, hosts, recent."""
    have = {r[0] for r in con.execute("DESCRIBE jobs").fetchall()}
    loss = [c for c in _LOSS_COLUMNS if c in have]  # a store before migration 2 has none
    jobs = _df(  # column names come from _LOSS_COLUMNS, never from the store
        con,
        "SELECT j.job, j.world, j.hosts, j.last_step, j.last_t"  # noqa: S608
        + "".join(f", j.{c}" for c in loss) + " FROM jobs j "
        "UNION ALL SELECT DISTINCT f.job, NULL, NULL, NULL, NULL"
        + ", NULL" * len(loss) + " FROM findings f "
        "WHERE f.job NOT IN (SELECT job FROM jobs)",
    )
    by_kind = _df(
        con,
        "SELECT f.job, f.kind, count(*) AS n, max(CASE f.action WHEN 'evict' THEN 2 "
        "WHEN 'recover' THEN 1 ELSE 0 END) AS worst FROM findings f "
        "LEFT JOIN triage t ON t.finding_id = f.finding_id "
        "WHERE coalesce(t.status, 'open') IN ('open', 'confirmed') "
        "GROUP BY f.job, f.kind ORDER BY f.job, n DESC, f.kind",
    )
    recent = _df(
        con,
        "SELECT job, count(*) AS n FROM findings WHERE detected_t >= ? GROUP BY job",
        [now_t - recent_s],
    )
    recent_n = dict(zip(recent["job"], recent["n"], strict=True))
    rows = []
    for j in jobs.itertuples(index=False):
        mine = by_kind[by_kind["job"] == j.job]
        n_open = int(mine["n"].sum())
        if n_open:
            worst = {2: "evict", 1: "recover", 0: "observe"}[int(mine["worst"].max())]
            parts = ", ".join(f"{int(r.n)} {r.kind}" for r in mine.itertuples(index=False))
            health = f"{worst}: {parts}"
        else:
            health = "healthy"
        rows.append({
            "job": j.job, "health": health, "open_findings": n_open,
            "last_step": None if pd.isna(j.last_step) else int(j.last_step),
            "last_seen": _when(None if pd.isna(j.last_t) else j.last_t),
            "ranks": None if pd.isna(j.world) else int(j.world),
            "hosts": None if pd.isna(j.hosts) else int(j.hosts),
            "findings_last_hour": int(recent_n.get(j.job, 0)),
            "lost": _loss_text({c: getattr(j, c) for c in loss}),
        })  # fmt: skip
    cols = ["job", "health", "open_findings", "last_step", "last_seen", "ranks", "hosts",
            "findings_last_hour", "lost"]  # fmt: skip
    return pd.DataFrame(rows, columns=cols).sort_values("job", ignore_index=True)


# What a job's telemetry lost on the way (store migration 2): words for each count.
_LOSS_COLUMNS = {
    "late": "late records", "forced": "steps closed early", "partial_frames": "partial steps",
    "refused": "records refused", "dropped": "dropped by collectors",
}


def _loss_text(counts: dict) -> str:
    """'none', or the non-zero loss counts in words ('3 late records, 823 dropped by ...')."""
    parts = [f"{int(n):,} {_LOSS_COLUMNS[c]}" for c, n in counts.items()
             if n is not None and not pd.isna(n) and int(n) > 0]  # fmt: skip
    return ", ".join(parts) if parts else ("none" if counts else "not recorded")


def latest_open_findings(con, *, limit: int = 20) -> pd.DataFrame:
    """The open findings of every job, worst action first, then newest, for the front page."""
    df = _df(
        con,
        "SELECT f.job, f.kind, f.ranks, f.hosts, f.first_step, f.last_step, f.action, "
        "f.detected_t, f.finding_id FROM findings f "
        "LEFT JOIN triage t ON t.finding_id = f.finding_id "
        "WHERE coalesce(t.status, 'open') IN ('open', 'confirmed') "
        "ORDER BY CASE f.action WHEN 'evict' THEN 0 WHEN 'recover' THEN 1 ELSE 2 END, "
        "f.detected_t DESC, f.finding_id LIMIT ?",
        [int(limit)],
    )
    return pd.DataFrame({
        "job": df["job"], "kind": df["kind"], "ranks": df["ranks"].map(_join),
        "hosts": df["hosts"].map(_join),
        "steps": [f"{a}-{b}" for a, b in zip(df["first_step"], df["last_step"], strict=True)],
        "action": df["action"], "detected": df["detected_t"].map(_when),
        "finding": df["finding_id"],
    })  # fmt: skip


def open_by_severity(con, *, per_job: int = 3) -> dict[str, list[dict]]:
    """Per job, its open findings worst first (evict > recover > observe, then newest).

    Every job of the store is a key (healthy ones map to ``[]``); at most
    ``per_job`` findings each, evidence parsed, for the first screen's banners.
    """
    df = _df(
        con,
        "SELECT * FROM (SELECT f.finding_id, f.job, f.kind, f.ranks, f.hosts, f.first_step, "
        "f.last_step, f.detected_step, f.detected_t, f.score, f.detector, f.action, f.evidence, "
        "f.unattributed, row_number() OVER (PARTITION BY f.job ORDER BY CASE f.action "
        "WHEN 'evict' THEN 0 WHEN 'recover' THEN 1 ELSE 2 END, f.detected_t DESC, "
        "f.finding_id) AS n FROM findings f LEFT JOIN triage t ON t.finding_id = f.finding_id "
        "WHERE coalesce(t.status, 'open') IN ('open', 'confirmed')) WHERE n <= ? "
        "ORDER BY job, n",
        [int(per_job)],
    )
    out: dict[str, list[dict]] = {j: [] for j in job_names(con)}
    for r in df.to_dict("records"):
        r["ranks"] = [int(x) for x in r["ranks"]] if r["ranks"] is not None else []
        r["hosts"] = list(r["hosts"]) if r["hosts"] is not None else []
        r["evidence"] = orjson.loads(r["evidence"]) if r["evidence"] else {}
        out.setdefault(r["job"], []).append(r)
    return out


def control_channel(con, job: str) -> bool:
    """Whether the job's findings went out over a control channel (``serve`` over Kafka).

    A replayed trace or the embedded demo never sends evict / recover
    messages, so for them "not delivered" would be a false alarm of its own.
    """
    row = con.execute("SELECT source FROM jobs WHERE job = ?", [job]).fetchone()
    return row is not None and row[0] == "kafka"


def finding_onsets(con, job: str, *, step_lo: int, step_hi: int) -> pd.DataFrame:
    """rank, onset_step, kind: each finding's first step at each rank it names, in a range."""
    return _df(
        con,
        "SELECT r AS rank, first_step AS onset_step, kind FROM findings, unnest(ranks) AS u(r) "
        "WHERE job = ? AND first_step BETWEEN ? AND ? ORDER BY rank, first_step",
        [job, int(step_lo), int(step_hi)],
    )


def job_world(con, job: str) -> int:
    """How many ranks the job has: its jobs row, else the highest rank seen + 1."""
    row = con.execute(
        "SELECT coalesce((SELECT world FROM jobs WHERE job = ?), "
        "(SELECT max(rank) + 1 FROM scores WHERE job = ?), "
        "(SELECT max(r) + 1 FROM findings, unnest(ranks) AS u(r) WHERE job = ?), 0)",
        [job, job, job],
    ).fetchone()
    return int(row[0] or 0)


def job_source(con, job: str) -> str | None:
    """Where the job's records came from (a trace path, ``kafka``, ``embedded://...``)."""
    row = con.execute("SELECT source FROM jobs WHERE job = ?", [job]).fetchone()
    return row[0] if row else None


def rank_host(con, job: str, rank: int) -> str | None:
    """The host a single-host finding places the rank on (None when none does)."""
    row = con.execute(
        "SELECT hosts[1] FROM findings WHERE job = ? AND len(hosts) = 1 "
        "AND list_contains(ranks, ?) ORDER BY detected_t DESC LIMIT 1",
        [job, int(rank)],
    ).fetchone()
    return row[0] if row else None


def filter_options(con, job: str) -> dict[str, list]:
    """The values each filter of a job's findings page can take (only those present)."""
    one = lambda sql: [r[0] for r in con.execute(sql, [job]).fetchall()]  # noqa: E731
    return {
        "kind": one("SELECT DISTINCT kind FROM findings WHERE job = ? ORDER BY 1"),
        "host": one("SELECT DISTINCT h FROM findings, unnest(hosts) AS u(h) WHERE job = ? "
                    "ORDER BY 1"),
        "rank": one("SELECT DISTINCT r FROM findings, unnest(ranks) AS u(r) WHERE job = ? "
                    "ORDER BY 1"),
        "action": one("SELECT DISTINCT action FROM findings WHERE job = ? ORDER BY 1"),
        "triage": list(TRIAGE_CHOICES),
    }  # fmt: skip


_FINDINGS_SQL = """
SELECT f.finding_id, f.job, f.kind, f.ranks, f.hosts, f.first_step, f.last_step,
       f.detected_step, f.detected_t, f.score, f.detector, f.action, f.evidence,
       f.unattributed, coalesce(t.status, 'open') AS triage, t.note, t.t AS triage_t,
       (SELECT string_agg(a.action || CASE WHEN a.delivered_t IS NULL THEN ' issued'
                                           ELSE ' delivered' END, ', ' ORDER BY a.step)
        FROM actions a WHERE a.finding_id = f.finding_id) AS delivery
FROM findings f LEFT JOIN triage t ON t.finding_id = f.finding_id
WHERE f.job = ?
  AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], f.kind))
  AND (len(?::VARCHAR[]) = 0 OR list_has_any(f.hosts, ?::VARCHAR[]))
  AND (len(?::INTEGER[]) = 0 OR list_has_any(f.ranks, ?::INTEGER[]))
  AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], f.action))
  AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], coalesce(t.status, 'open')))
ORDER BY f.detected_t DESC, f.first_step DESC, f.finding_id
"""


def job_findings(con, job: str, *, kinds=(), hosts=(), ranks=(), actions=(),
                 triage=()) -> pd.DataFrame:  # fmt: skip
    """A job's findings, newest first, narrowed by any of the filters (empty: no filter)."""
    kinds, hosts, actions, triage = (list(map(str, x)) for x in (kinds, hosts, actions, triage))
    ranks = [int(r) for r in ranks]
    params = [job, kinds, kinds, hosts, hosts, ranks, ranks, actions, actions, triage, triage]
    df = _df(con, _FINDINGS_SQL, params)
    df["ranks"] = df["ranks"].map(lambda r: [int(x) for x in r] if r is not None else [])
    df["hosts"] = df["hosts"].map(lambda h: list(h) if h is not None else [])
    df["evidence"] = df["evidence"].map(lambda e: orjson.loads(e) if e else {})
    return df


def _join(items) -> str:
    return " ".join(str(x) for x in items) if items is not None else ""


def findings_table(df: pd.DataFrame) -> pd.DataFrame:
    """The columns a person reads in a findings table (lists as text)."""
    return pd.DataFrame({
        "finding": df["finding_id"], "kind": df["kind"], "ranks": df["ranks"].map(_join),
        "hosts": df["hosts"].map(_join), "first_step": df["first_step"],
        "last_step": df["last_step"], "detected_step": df["detected_step"],
        "score": df["score"].round(2), "action": df["action"],
        "delivery": df["delivery"].fillna("none issued"), "triage": df["triage"],
        "detector": df["detector"],
    })  # fmt: skip


def findings_csv(df: pd.DataFrame) -> bytes:
    """Findings as CSV: the trace format's findings fields plus id, triage, note, delivery."""
    out = df[["finding_id", "job", "kind", "ranks", "hosts", "first_step", "last_step",
              "detected_step", "detected_t", "score", "detector", "action", "delivery",
              "triage", "note", "evidence"]].copy()  # fmt: skip
    out["ranks"] = out["ranks"].map(_join)
    out["hosts"] = out["hosts"].map(_join)
    out["evidence"] = out["evidence"].map(lambda e: orjson.dumps(e).decode())
    return out.to_csv(index=False).encode()


def finding_labels(df: pd.DataFrame) -> dict[str, str]:
    """finding id -> one line naming it, in the DataFrame's order (for pickers)."""
    return {
        r.finding_id: f"{r.kind} · ranks {_join(r.ranks[:8]) or '-'} · steps "
        f"{r.first_step}-{r.last_step} · {r.action} · {r.finding_id}"
        for r in df.itertuples(index=False)
    }


def finding(con, finding_id: str) -> dict | None:
    """One finding with its triage, evidence parsed; None when the id is unknown."""
    cur = con.execute(
        "SELECT f.*, coalesce(t.status, 'open') AS triage, t.note, t.t AS triage_t "
        "FROM findings f LEFT JOIN triage t ON t.finding_id = f.finding_id "
        "WHERE f.finding_id = ?",
        [finding_id],
    )
    row = cur.fetchone()
    if row is None:
        return None
    d = dict(zip([c[0] for c in cur.description], row, strict=True))
    d["evidence"] = orjson.loads(d["evidence"]) if d["evidence"] else {}
    d["ranks"] = [int(r) for r in d["ranks"] or []]
    d["hosts"] = list(d["hosts"] or [])
    d["score"] = float(d["score"]) if d["score"] is not None else math.nan
    return d


def affected(con, f: dict) -> pd.DataFrame:
    """The finding's hosts, the ranks it names on each, and what else is open on that host."""
    roll = _df(
        con,
        "SELECT host, findings, action AS worst_action FROM host_rollup "
        "WHERE job = ? AND list_contains(?::VARCHAR[], host)",
        [f["job"], f["hosts"]],
    )
    info = {r.host: r for r in roll.itertuples(index=False)}
    one_host = len(f["hosts"]) == 1
    rows = []
    for h in f["hosts"] or ["(unknown)"]:
        r = info.get(h)
        rows.append({
            "host": h,
            "ranks": _join(f["ranks"]) if one_host else _join(_ranks_on_host(con, f, h)),
            "findings_on_host": int(r.findings) if r is not None else 0,
            "worst_action_on_host": r.worst_action if r is not None else "",
        })  # fmt: skip
    return pd.DataFrame(rows)


def _ranks_on_host(con, f: dict, host: str) -> list[int]:
    known = set(host_ranks(con, f["job"], host)["rank"])
    return [r for r in f["ranks"] if r in known]


def finding_actions(con, finding_id: str, *, channel: bool = True) -> pd.DataFrame:
    """Evict / recover decisions of one finding: when issued and whether delivered.

    Without a control channel (``channel=False``) delivery is "none: no control
    channel" rather than "not delivered".
    """
    df = _df(
        con,
        "SELECT action, step, issued_t, delivered_t, hosts FROM actions "
        "WHERE finding_id = ? ORDER BY step, action",
        [finding_id],
    )
    return pd.DataFrame({
        "action": df["action"], "at_step": df["step"], "hosts": df["hosts"].map(_join),
        "issued": df["issued_t"].map(_when),
        "delivered": df["delivered_t"].map(
            lambda t: _when(t) or ("not delivered" if channel else "none: no control channel")),
    })  # fmt: skip


def job_hosts(con, job: str) -> list[str]:
    """Hosts the store knows for a job (named by its findings or actions), sorted."""
    rows = con.execute(
        "SELECT DISTINCT h FROM (SELECT unnest(hosts) AS h FROM findings WHERE job = ? "
        "UNION ALL SELECT unnest(hosts) FROM actions WHERE job = ?) WHERE h IS NOT NULL "
        "ORDER BY h",
        [job, job],
    ).fetchall()
    return [r[0] for r in rows]


def host_ranks(con, job: str, host: str, *, also=()) -> pd.DataFrame:
    """The ranks of a host: ``also`` (placed by the trace) plus those its findings place there.

    The store has no rank -> host table: without a trace a rank is placed on
    a host only when a finding names that host alone. Each rank's findings on
    this host are counted, with their kinds and worst action.
    """
    found = _df(
        con,
        "SELECT r AS rank, count(*) AS findings, string_agg(DISTINCT kind, ', ') AS kinds, "
        "CASE max(CASE action WHEN 'evict' THEN 2 WHEN 'recover' THEN 1 ELSE 0 END) "
        "WHEN 2 THEN 'evict' WHEN 1 THEN 'recover' ELSE 'observe' END AS worst_action, "
        "max(last_step) AS last_step FROM findings, unnest(ranks) AS u(r) "
        "WHERE job = ? AND list_contains(hosts, ?) AND (len(hosts) = 1 OR "
        "list_contains(?::INTEGER[], r)) GROUP BY r ORDER BY r",
        [job, host, [int(r) for r in also]],
    )
    extra = sorted(set(int(r) for r in also) - set(found["rank"]))
    if extra:
        none = pd.DataFrame({"rank": extra, "findings": 0, "kinds": "", "worst_action": "",
                             "last_step": None})  # fmt: skip
        found = pd.concat([found, none], ignore_index=True).sort_values("rank", ignore_index=True)
    found["findings"] = found["findings"].astype(int)
    found["last_step"] = found["last_step"].astype("Int64")
    return found


def set_triage(con, finding_id: str, status: str, note: str = "", *,
               t: float | None = None) -> None:  # fmt: skip
    """Store a person's verdict on a finding (``open`` removes the verdict)."""
    write_triage(con, finding_id, status, note, t=t)


def triage_log(con, job: str) -> pd.DataFrame:
    """A job's triaged findings, most recent verdict first."""
    df = _df(
        con,
        "SELECT t.t, t.status, t.note, f.kind, f.ranks, f.hosts, t.finding_id FROM triage t "
        "JOIN findings f ON f.finding_id = t.finding_id WHERE f.job = ? ORDER BY t.t DESC",
        [job],
    )
    return pd.DataFrame({
        "when": df["t"].map(_when), "status": df["status"], "note": df["note"],
        "kind": df["kind"], "ranks": df["ranks"].map(_join), "hosts": df["hosts"].map(_join),
        "finding": df["finding_id"],
    })  # fmt: skip

"""Questions about per-rank scores: the rank x step heatmap, a finding's score history, GPUs.

The store keeps scores in step buckets (pipeline/engine/scores.py: one row per
bucket, rank and metric, the score of largest magnitude in the bucket). A
4,096-rank job is still far more cells than a browser should draw, so the
heatmap is binned again here, in SQL, to at most ``max_ranks`` x
``max_steps`` cells, each keeping the score of largest magnitude (signed), so
a single slow rank in a bin of 32 still colors its cell. Only a few thousand
rows ever leave DuckDB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson
import pandas as pd

__all__ = [
    "ScoreExtent", "HeatmapBins", "score_metrics", "score_extent", "heatmap_cells",
    "top_ranks", "score_history", "host_gpu", "gpu_events", "GPU_METRIC_PREFIX",
]  # fmt: skip

GPU_METRIC_PREFIX = "gpu_"  # the engine names consensus scores of GPU readings gpu_<reading>


@dataclass(slots=True, frozen=True)
class ScoreExtent:
    """What the scores of one job and metric cover."""

    ranks: int  # highest rank + 1
    step_lo: int  # first step covered
    step_hi: int  # last step covered
    bucket_steps: int  # steps per stored row


@dataclass(slots=True, frozen=True)
class HeatmapBins:
    """How the drawn cells map to ranks and steps."""

    ranks: int
    steps: int
    rank_bins: int
    step_bins: int
    ranks_per_cell: int
    steps_per_cell: int


def score_metrics(con, job: str) -> list[str]:
    """Metrics with stored scores for a job, compute time first when present."""
    rows = con.execute(
        "SELECT DISTINCT metric FROM scores WHERE job = ? ORDER BY metric", [job]
    ).fetchall()
    names = [r[0] for r in rows]
    first = [m for m in ("compute_s", "comm_s", "grad_norm") if m in names]
    return first + [m for m in names if m not in first]


def score_extent(con, job: str, metric: str) -> ScoreExtent | None:
    row = con.execute(
        "SELECT max(rank) + 1, min(step), max(step + steps - 1), max(steps) FROM scores "
        "WHERE job = ? AND metric = ?",
        [job, metric],
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return ScoreExtent(int(row[0]), int(row[1]), int(row[2]), max(1, int(row[3])))


def heatmap_cells(con, job: str, metric: str, *, max_ranks: int, max_steps: int,
                  step_lo: int | None = None, step_hi: int | None = None,
                  ) -> tuple[pd.DataFrame, HeatmapBins]:  # fmt: skip
    """Binned rank x step cells: rank_lo, rank_hi, step_lo, step_hi (exclusive ends), score."""
    ext = score_extent(con, job, metric)
    cols = ["rank_lo", "rank_hi", "step_lo", "step_hi", "score"]
    if ext is None:
        return pd.DataFrame(columns=cols), HeatmapBins(0, 0, 0, 0, 1, 1)
    lo = ext.step_lo if step_lo is None else max(int(step_lo), ext.step_lo)
    hi = ext.step_hi if step_hi is None else min(int(step_hi), ext.step_hi)
    hi = max(hi, lo)
    b = ext.bucket_steps
    base = (lo // b) * b  # cells start on bucket boundaries, so no bucket straddles two cells
    span = hi - base + 1
    spc = max(b, math.ceil(span / max_steps))
    spc = math.ceil(spc / b) * b
    rpc = max(1, math.ceil(ext.ranks / max_ranks))
    df = con.execute(
        "SELECT rb * ? AS rank_lo, least(rb * ? + ?, ?) AS rank_hi, "
        "? + sb * ? AS step_lo, ? + sb * ? + ? AS step_hi, score FROM ("
        "  SELECT rank // ? AS rb, (step - ?) // ? AS sb, arg_max(score, abs(score)) AS score"
        "  FROM scores WHERE job = ? AND metric = ? AND step + steps > ? AND step <= ?"
        "  GROUP BY rb, sb) ORDER BY rank_lo, step_lo",
        [rpc, rpc, rpc, ext.ranks, base, spc, base, spc, spc, rpc, base, spc,
         job, metric, lo, hi],
    ).df()  # fmt: skip
    bins = HeatmapBins(
        ranks=ext.ranks, steps=hi - lo + 1, rank_bins=math.ceil(ext.ranks / rpc),
        step_bins=math.ceil(span / spc), ranks_per_cell=rpc, steps_per_cell=spc,
    )  # fmt: skip
    return df[cols], bins


_TOP_RANKS_SQL = """
WITH s AS (
  SELECT rank, step, steps, score FROM scores
  WHERE job = $job AND metric = $metric AND step + steps > $lo AND step <= $hi),
over AS (  -- contiguous buckets over the threshold share step - running sum of steps
  SELECT rank, step, least(step + steps - 1, $hi) - greatest(step, $lo) + 1 AS n,
         step - sum(steps) OVER (PARTITION BY rank ORDER BY step) AS grp
  FROM s WHERE abs(score) >= $thr),
runs AS (SELECT rank, greatest(min(step), $lo) AS start, sum(n) AS n FROM over GROUP BY rank, grp),
per AS (SELECT rank, sum(n)::BIGINT AS steps_over, max(n)::BIGINT AS longest_run,
               arg_max(start, n) AS longest_run_from FROM runs GROUP BY rank),
peak AS (SELECT rank, round(arg_max(score, abs(score)), 2) AS peak_score,
                arg_max(step, abs(score)) AS peak_step, max(abs(score)) AS m FROM s GROUP BY rank)
SELECT p.rank, coalesce(r.steps_over, 0) AS steps_over, coalesce(r.longest_run, 0) AS longest_run,
       r.longest_run_from, p.peak_score, p.peak_step
FROM peak p LEFT JOIN per r USING (rank)
ORDER BY steps_over DESC, longest_run DESC, p.m DESC, p.rank LIMIT $limit
"""


def top_ranks(con, job: str, metric: str, *, step_lo: int, step_hi: int,
              limit: int = 10, threshold: float = 3.0) -> pd.DataFrame:  # fmt: skip
    """The ranks that stayed away from their peers longest in a step range.

    Ranked by persistence: the steps (of stored buckets, clipped to the range)
    whose |score| reached ``threshold``; a one-step spike weighs one step, a
    straggler that lasts 90 steps weighs 90. ``longest_run_from`` is where
    the longest unbroken run over the threshold starts, ``peak_score`` the signed score of largest
    magnitude and ``peak_step`` its step.
    """
    return con.execute(_TOP_RANKS_SQL, {
        "job": job, "metric": metric, "lo": int(step_lo), "hi": int(step_hi),
        "thr": float(threshold), "limit": int(limit)}).df()  # fmt: skip


def score_history(con, job: str, metric: str, ranks: list[int], *, step_lo: int,
                  step_hi: int, max_ranks: int = 8) -> pd.DataFrame:  # fmt: skip
    """Per step: the blamed ranks' scores (``rank N`` columns) and the others' p10/median/p90."""
    ranks = [int(r) for r in ranks[:max_ranks]]
    args = [job, metric, int(step_lo), int(step_hi), ranks]
    others = con.execute(
        "SELECT step, quantile_cont(score, 0.1) AS peer_p10, median(score) AS peer_median, "
        "quantile_cont(score, 0.9) AS peer_p90 FROM scores WHERE job = ? AND metric = ? "
        "AND step BETWEEN ? AND ? AND NOT list_contains(?::INTEGER[], rank) "
        "GROUP BY step ORDER BY step",
        args,
    ).df()
    mine = con.execute(
        "SELECT step, rank, score FROM scores WHERE job = ? AND metric = ? "
        "AND step BETWEEN ? AND ? AND list_contains(?::INTEGER[], rank)",
        args,
    ).df()
    if mine.empty:
        return pd.DataFrame()
    wide = mine.pivot_table(index="step", columns="rank", values="score", aggfunc="first")
    wide.columns = [f"rank {c}" for c in wide.columns]
    return others.merge(wide.reset_index(), on="step", how="outer").sort_values("step")


def host_gpu(con, job: str, host: str) -> pd.DataFrame:
    """GPU consensus scores (metric ``gpu_*``) over steps of the ranks known on a host.

    Raw NVML samples are not in the store (schema version 1 keeps findings and
    scores only), so a host's GPU health over time is what the GPU detectors
    scored: how far each GPU's readings sat from its peers', step by step.
    """
    return con.execute(
        "SELECT s.step, s.rank, substr(s.metric, ?) AS reading, s.score FROM scores s "
        "WHERE s.job = ? AND starts_with(s.metric, ?) AND s.rank IN ("
        "  SELECT DISTINCT r FROM findings, unnest(ranks) AS u(r)"
        "  WHERE job = ? AND len(hosts) = 1 AND hosts[1] = ?) "
        "ORDER BY s.metric, s.rank, s.step",
        [len(GPU_METRIC_PREFIX) + 1, job, GPU_METRIC_PREFIX, job, host],
    ).df()


def gpu_events(con, job: str, host: str) -> pd.DataFrame:
    """XIDs, ECC growth, temperature and throttle causes named by GPU findings on a host."""
    df = con.execute(
        "SELECT finding_id, first_step, last_step, detected_step, ranks, action, evidence "
        "FROM findings WHERE job = ? AND kind = 'gpu' AND list_contains(hosts, ?) "
        "ORDER BY detected_step",
        [job, host],
    ).df()
    rows = []
    for r in df.itertuples(index=False):
        ev = orjson.loads(r.evidence) if r.evidence else {}
        causes = ev.get("causes") or [_throttle_cause(ev)]
        for c in causes:
            c = c if isinstance(c, dict) else {"cause": str(c)}
            detail = ", ".join(f"{k}={v}" for k, v in c.items() if k != "cause")
            rows.append({
                "step": int(r.detected_step), "gpu": ev.get("gpu"),
                "ranks": " ".join(map(str, r.ranks)), "event": str(c.get("cause")),
                "detail": detail, "action": r.action, "finding": r.finding_id,
            })  # fmt: skip
    return pd.DataFrame(rows, columns=["step", "gpu", "ranks", "event", "detail", "action",
                                       "finding"])  # fmt: skip


def _throttle_cause(ev: dict) -> dict:
    """A throttling finding (detectors/gpu/throttle.py) as one cause with its readings."""
    cause = {"cause": "throttle: " + (", ".join(map(str, ev.get("clock_events") or []))
                                      or str(ev.get("metric") or "gpu"))}  # fmt: skip
    for key in ("temp_c", "power_w", "sm_clock_mhz"):
        if ev.get(key) is not None:
            cause[key] = ev[key]
    if ev.get("metric") and ev.get("peer_median") is not None:
        cause[f"peer_median_{ev['metric']}"] = ev["peer_median"]
    if ev.get("reasons"):
        cause["reasons"] = " ".join(map(str, ev["reasons"]))
    return cause

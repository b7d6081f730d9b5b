"""Per-rank detector scores for the dashboard's rank x step heatmap, bounded in size.

Keeping every score of every rank of every step does not scale: a 4,096-rank
x 5,000-step job is 20 million cells per metric. Scores are therefore kept
in *step buckets*: each row is one (bucket, rank, metric) with the score of
largest magnitude inside the bucket, so a one-step spike is never averaged
away. The bucket width is fixed per job from its size, so that a step costs
at most ``cells_per_step`` stored cells on average:

    bucket_steps = max(1, ceil(world x metrics / cells_per_step))

With the default 1,024 cells a step, jobs up to ~200 ranks (every sample
trace) keep every step exactly; 4,096 ranks x 5 metrics keep one row per 20
steps (5,000 steps -> about 5 million rows in all instead of 100 million);
16,384 ranks keep one per 80 steps. Rows carry ``steps`` (the bucket width)
so a reader knows what a cell covers.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ScoreBuckets", "SCORE_COLUMNS"]

SCORE_COLUMNS = ("job", "step", "steps", "rank", "metric", "score")


class ScoreBuckets:
    """Accumulates one job's per-step score arrays into bucket rows."""

    __slots__ = ("job", "cells_per_step", "bucket_steps", "_bucket", "_acc", "_rows")

    def __init__(self, job: str, cells_per_step: int) -> None:
        self.job = job
        self.cells_per_step = cells_per_step
        self.bucket_steps = 0  # decided at the first step that has scores
        self._bucket: int | None = None
        self._acc: dict[str, np.ndarray] = {}
        self._rows: list[dict[str, np.ndarray]] = []

    def add(self, step: int, world: int, rank: np.ndarray, scores: dict[str, np.ndarray]) -> None:
        """Fold one step's scores (metric -> array over the frame's rows) in."""
        if not scores:
            return
        if not self.bucket_steps:
            cells = max(world, 1) * len(scores)
            self.bucket_steps = max(1, math.ceil(cells / self.cells_per_step))
        bucket = step // self.bucket_steps
        if self._bucket is not None and bucket != self._bucket:
            self._close()
        self._bucket = bucket
        top = max(world, int(rank.max()) + 1 if rank.size else 0)
        for metric, values in scores.items():
            vals = np.asarray(values, dtype=np.float64)
            if vals.shape != rank.shape:
                continue
            acc = self._acc.get(metric)
            if acc is None or acc.size < top:
                grown = np.full(top, np.nan)
                if acc is not None:
                    grown[: acc.size] = acc
                acc = self._acc[metric] = grown
            cur = acc[rank]
            with np.errstate(invalid="ignore"):
                take = np.isfinite(vals) & ~(np.abs(cur) >= np.abs(vals))
            acc[rank[take]] = vals[take]

    def _close(self) -> None:
        start = self._bucket * self.bucket_steps
        for metric, acc in self._acc.items():
            ranks = np.flatnonzero(np.isfinite(acc))
            if ranks.size:
                self._rows.append(
                    {
                        "metric": metric,
                        "step": start,
                        "rank": ranks.astype(np.int64),
                        "score": acc[ranks].copy(),
                    }
                )
        self._acc = {}

    def state_dict(self) -> dict:
        """The open bucket (JSON-safe: finite cells only), so a restart loses no scores."""
        acc = {}
        for metric, a in self._acc.items():
            ranks = np.flatnonzero(np.isfinite(a))
            acc[metric] = {"size": int(a.size), "rank": ranks.tolist(), "score": a[ranks].tolist()}
        return {"bucket_steps": self.bucket_steps, "bucket": self._bucket, "acc": acc}

    def load_state_dict(self, d: dict) -> None:
        self.bucket_steps = int(d.get("bucket_steps") or 0)
        self._bucket = d.get("bucket")
        self._acc = {}
        for metric, cells in (d.get("acc") or {}).items():
            a = np.full(int(cells["size"]), np.nan)
            a[np.asarray(cells["rank"], dtype=np.int64)] = np.asarray(cells["score"], np.float64)
            self._acc[str(metric)] = a

    def drain(self, final: bool = False) -> dict[str, np.ndarray] | None:
        """Rows of finished buckets (all buckets when ``final``) as columns, or None."""
        if final and self._bucket is not None:
            self._close()
            self._bucket = None
        if not self._rows:
            return None
        rows, self._rows = self._rows, []
        n = sum(r["rank"].size for r in rows)
        return {
            "job": np.full(n, self.job, dtype=object),
            "step": np.concatenate([np.full(r["rank"].size, r["step"], np.int64) for r in rows]),
            "steps": np.full(n, self.bucket_steps, dtype=np.int64),
            "rank": np.concatenate([r["rank"] for r in rows]),
            "metric": np.concatenate(
                [np.full(r["rank"].size, r["metric"], dtype=object) for r in rows]
            ),
            "score": np.concatenate([r["score"] for r in rows]),
        }

"""How a step's compute time depends on its tokens, per peer group, learnt from clean steps.

Design notes: docs/detectors.md, "detectors/straggler/token_model.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.consensus import peer_consensus

__all__ = ["TokenModel", "per_median_batch"]

_FORGET = 1.0 / 256.0  # weight lost per learnt step: the fit spans a few hundred steps


class TokenModel:
    """Per-group least-squares line through (relative tokens, relative compute)."""

    __slots__ = ("keys", "stats", "min_rows", "pending")

    def __init__(self, min_rows: int = 20) -> None:
        self.keys = np.zeros(0, dtype=np.int64)
        self.stats = np.zeros((5, 0))  # weight, sum x, sum y, sum xx, sum xy per group
        self.min_rows = int(min_rows)
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def expected(self, idx, x: np.ndarray) -> np.ndarray:
        """Per row: expected relative compute at relative tokens ``x`` (NaN: no model)."""
        out = np.full(x.shape[0], np.nan)
        if not np.array_equal(idx.keys, self.keys):
            return out
        w, sx, sy, sxx, sxy = self.stats
        with np.errstate(invalid="ignore", divide="ignore"):
            var = sxx / w - (sx / w) ** 2
            beta = (sxy / w - sx * sy / w**2) / var
            alpha = sy / w - beta * sx / w
            ready = (w >= self.min_rows) & (var > 1e-4) & (beta >= 0)
        alpha = np.where(ready, alpha, np.nan)
        beta = np.where(ready, beta, np.nan)
        return idx.rows(alpha) + idx.rows(beta) * x

    def offer(self, idx, x: np.ndarray, y: np.ndarray) -> None:
        """This step's relative tokens and compute, learnt if ``learn`` finds the rows clean."""
        self.pending = (idx.keys.copy(), idx.row_gid.copy(), x, y)

    def learn(self, clean: np.ndarray) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        keys, gid, x, y = pending
        if clean.shape[0] != x.shape[0]:
            return
        if not np.array_equal(keys, self.keys):
            self.keys = keys
            self.stats = np.zeros((5, keys.shape[0]))
        ok = clean & np.isfinite(x) & np.isfinite(y)
        g = gid[ok]
        xs, ys = x[ok], y[ok]
        size = keys.shape[0]
        self.stats *= 1.0 - _FORGET
        for i, v in enumerate((np.ones_like(xs), xs, ys, xs * xs, xs * ys)):
            self.stats[i] += np.bincount(g, weights=v, minlength=size)

    def state_dict(self) -> dict:
        return {"keys": self.keys.tolist(), "stats": self.stats.tolist()}

    def load_state_dict(self, d: dict) -> None:
        if not d:
            return
        self.keys = np.asarray(d.get("keys", []), dtype=np.int64)
        self.stats = np.asarray(d.get("stats", []), dtype=np.float64).reshape(5, -1)


def per_median_batch(frame, idx, x: np.ndarray, i: int, model: TokenModel
                     ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(``x`` with metric ``i`` scaled to what each row would have taken on its group's
    median batch, per row whether it was): the model's expectation there over its
    expectation at the row's tokens; unchanged where the model is not ready. The pair
    rules judge a rank against its partner and its own history, and without this a run
    of long batches on one replica of a dp 2 varlen job read as slowness."""
    tokens = frame.m.get("tokens")
    if tokens is None:
        return x, np.zeros(x.shape[1], dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = tokens / peer_consensus(idx, tokens).median[0]
        factor = model.expected(idx, np.ones_like(rel)) / model.expected(idx, rel)
    ok = np.isfinite(factor) & (factor > 0)
    if not ok.any():
        return x, ok
    out = x.copy()
    out[i] = np.where(ok, x[i] * factor, x[i])
    return out, ok

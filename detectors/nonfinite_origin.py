"""Non-finite origin: which ranks produced the first NaN/Inf of an incident.

Design notes: docs/detectors.md, "detectors/nonfinite_origin.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import num
from rankscope.detectors.frame import NAMED_BITS, StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.stats.persistence import usable_ranks

__all__ = ["NonfiniteConfig", "NonfiniteState", "detect"]

NAME = "nonfinite_origin"


@dataclass(kw_only=True, slots=True)
class NonfiniteConfig:
    """Settings of the non-finite origin detector."""

    # the incident ends after this many consecutive all-finite steps
    quiet_steps_to_close: int = 1
    # consecutive skipped (GradScaler-handled) non-finite steps before it is an incident
    handled_skips: int = 4

    def __post_init__(self) -> None:
        if self.quiet_steps_to_close < 1:
            raise ValueError("quiet_steps_to_close must be >= 1")
        if self.handled_skips < 1:
            raise ValueError("handled_skips must be >= 1")


class NonfiniteState:
    """Whether an incident is open, and which ranks report which columns at all.

    JSON has no NaN, so a non-finite norm often arrives as null, which the frame
    also uses for "not reported". A NaN counts as a non-finite reading where the
    record named it so (``nonfinite_fields``, frame column ``nonfinite_named``), or
    for a rank that has reported a finite value in that column before (per rank:
    with pipeline parallelism only the last stage may report loss).
    """

    __slots__ = ("open", "quiet", "origin_step", "seen", "skips")

    def __init__(self, cfg: NonfiniteConfig | None = None) -> None:
        self.open = False
        self.quiet = 0
        self.skips = 0  # consecutive skipped steps with non-finite readings
        self.origin_step = -1
        self.seen: dict[str, np.ndarray] = {c: np.zeros(0, dtype=bool) for c in _COLUMNS}

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        """Nothing to learn: the rule has no baseline (``seen`` updates in detect)."""

    def state_dict(self) -> dict:
        return {
            "open": self.open,
            "quiet": self.quiet,
            "origin_step": self.origin_step,
            "skips": self.skips,
            "seen": {c: np.flatnonzero(v).tolist() for c, v in self.seen.items()},
        }

    def load_state_dict(self, d: dict) -> None:
        self.open = bool(d.get("open", False))
        self.quiet = int(d.get("quiet", 0))
        self.origin_step = int(d.get("origin_step", -1))
        self.skips = int(d.get("skips", 0))
        seen = d.get("seen", {})
        for c in _COLUMNS:
            ranks = np.asarray(seen.get(c, []), dtype=np.int64)
            arr = np.zeros(int(ranks.max()) + 1 if ranks.size else 0, dtype=bool)
            arr[ranks] = True
            self.seen[c] = arr


_COLUMNS = ("grad_norm", "grad_norm_reduced", "loss")


def _nonfinite(frame: StepFrame, state: NonfiniteState, col: str) -> np.ndarray:
    """Rows whose ``col`` is inf, or NaN named non-finite by the record or on a rank
    that has reported the column before (a bare null from another writer)."""
    x = frame.m.get(col)
    if x is None or frame.n == 0:
        return np.zeros(frame.n, dtype=bool)
    seen = state.seen[col]
    ok = usable_ranks(frame.rank)
    ranks = np.where(ok, frame.rank, 0)
    top = int(ranks.max()) + 1
    if seen.shape[0] < top:
        seen = np.concatenate([seen, np.zeros(top - seen.shape[0], dtype=bool)])
    finite = np.isfinite(x)
    state.seen[col] = seen
    if finite.all():  # the common case: nothing non-finite, every rank reports
        if not seen[ranks].all():
            seen[ranks[ok]] = True
        return np.zeros(frame.n, dtype=bool)
    was_seen = seen[ranks] & ok
    seen[ranks[finite & ok]] = True
    return np.isinf(x) | (np.isnan(x) & (was_seen | _named(frame, col)))


def _named(frame: StepFrame, col: str) -> np.ndarray:
    """Rows whose record named ``col`` non-finite (``nonfinite_fields``): a NaN there
    is a reading, not a gap, on any rank (seen before or not)."""
    mask = frame.m.get("nonfinite_named")
    if mask is None:
        return np.zeros(frame.n, dtype=bool)
    return (np.nan_to_num(mask, nan=0.0).astype(np.int64) & NAMED_BITS[col]) > 0


def _handled(frame: StepFrame) -> bool:
    """The loop skipped this step's update on a strict majority of the ranks reporting."""
    skipped = frame.m.get("skipped")
    if skipped is None or frame.n == 0:
        return False
    return int(np.count_nonzero(skipped == 1.0)) * 2 > frame.n


def detect(frame: StepFrame, state: NonfiniteState, cfg: NonfiniteConfig) -> DetectorOutput:
    """The ranks whose local gradient (or loss) went non-finite first in an incident."""
    n = frame.n
    nf = frame.m.get("nonfinite", np.full(n, np.nan))
    g_bad = _nonfinite(frame, state, "grad_norm")
    loss_bad = _nonfinite(frame, state, "loss")
    reduced_bad = _nonfinite(frame, state, "grad_norm_reduced")
    counted_zero = nf == 0  # the rank counted its gradient's non-finite elements: none
    overflow = g_bad & counted_zero  # finite elements, norm overflowed: a huge value (SDC)
    local_bad = (np.nan_to_num(nf, nan=0.0) > 0) | (g_bad & ~counted_zero)
    any_bad = bool(local_bad.any() or loss_bad.any() or reduced_bad.any() or overflow.any())
    out = DetectorOutput()
    if not any_bad:
        state.skips = 0
        if state.open:
            state.quiet += 1
            if state.quiet >= cfg.quiet_steps_to_close:
                state.open = False
        return out
    state.quiet = 0
    if state.open or _contained(frame, local_bad, loss_bad, overflow):
        return out
    if _handled(frame):
        state.skips += 1
        if state.skips < cfg.handled_skips:
            return out  # GradScaler skipped the update: routine loss-scale backoff
    else:
        state.skips = 0
    state.open = True
    state.origin_step = frame.step
    downstream = np.zeros(0, dtype=np.int64)
    if local_bad.any():
        basis, rows = "local_grad", np.flatnonzero(local_bad)
        rows, downstream = _forward_first(frame, rows, loss_bad)
    elif loss_bad.any():
        basis, rows = "loss", np.flatnonzero(loss_bad)
    elif overflow.any() or reduced_bad.sum() * 2 < n:
        # finite but huge local values, or a minority's reduction went wrong: silent data
        # corruption, reported as such by metric_outlier / reduced_grad. The incident is
        # open all the same, so its aftermath is not blamed here.
        return out
    else:
        basis, rows = "reduced_only", np.flatnonzero(reduced_bad)
    # a lone origin beside a finite peer is named even as half of a 2-rank job: its peer
    # ran the same weights to a finite gradient, so the NaN is this rank's own
    unattributed = basis == "reduced_only" or rows.size == n or (rows.size > 1
                                                                 and rows.size * 2 >= n)
    ranks = tuple(int(r) for r in frame.rank[rows])
    g = frame.m.get("grad_norm", np.full(n, np.nan))
    others = np.setdiff1d(np.arange(n), rows)
    healthy = g[others][np.isfinite(g[others])]
    evidence = {
        "metric": "nonfinite",
        "value": num(nf[rows[0]]) if rows.size else None,
        "peer_median": num(np.median(healthy)) if healthy.size else None,
        "peers": [num(v) for v in healthy[:16]],
        "history_median": None,
        "basis": basis,
        "nonfinite": [num(v) for v in nf[rows[:16]]],
        "grad_norm": [num(v) for v in g[rows[:16]]],
        "ranks_with_nonfinite_reduced": int(reduced_bad.sum()),
        "backward_only": [int(r) for r in frame.rank[downstream[:16]]],
        "ranks_reporting": n,
    }
    out.signals.append(
        Signal(
            kind="nonfinite",
            ranks=ranks,
            detector=NAME,
            score=float(1.0 - rows.size / max(n, 1)),
            severity="oneshot",
            evidence=evidence,
            unattributed=bool(unattributed),
        )
    )
    return out


def _contained(frame: StepFrame, local_bad, loss_bad, overflow) -> bool:
    """A non-finite local gradient that no reduced gradient carries: every rank
    reports a finite ``grad_norm_reduced`` and no loss went non-finite, so the update
    every rank applied was finite. Seen on torchtitan 0.3's chunked loss under
    pipelining: its first step reduce-scatters an all-NaN lm_head gradient whose
    result the step's later reduction replaces. A faulty rank's NaN reaches the
    update: every replica, or the shard that holds it, then reads non-finite."""
    reduced = frame.m.get("grad_norm_reduced")
    if reduced is None or not local_bad.any() or loss_bad.any() or overflow.any():
        return False
    return bool(frame.n and np.isfinite(reduced).all())


def _forward_first(frame: StepFrame, rows: np.ndarray, loss_bad: np.ndarray):
    """Of the ranks with non-finite local gradients, drop those whose loss was finite
    when another of them had a non-finite loss: their forward was clean, so the NaN
    reached them in backward (a tensor-parallel partner's all-reduce, a pipeline
    stage's gradient). Ranks that report no loss stay (an earlier pipeline stage may
    be the origin). Returns (rows kept, rows dropped)."""
    loss = frame.m.get("loss")
    if loss is None or not loss_bad[rows].any():
        return rows, np.zeros(0, dtype=np.int64)
    clean_fwd = np.isfinite(loss[rows])
    if not clean_fwd.any():
        return rows, np.zeros(0, dtype=np.int64)
    return rows[~clean_fwd], rows[clean_fwd]


CONFIG = NonfiniteConfig
STATE = NonfiniteState

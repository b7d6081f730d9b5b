"""Reduced gradient vote: every replica must see the same all-reduced gradient.

Design notes: docs/detectors.md, "detectors/votes/reduced_grad.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.votes.vote import ReplicaState, replica_groups

__all__ = ["ReducedGradConfig", "ReducedGradState", "detect"]

NAME = "reduced_grad"


@dataclass(kw_only=True, slots=True)
class ReducedGradConfig:
    """Settings of the reduced gradient norm vote."""

    rel_tol: float = 1e-6  # values within this relative distance count as equal
    report_unattributed: bool = True  # report splits without a strict majority (no blame)

    def __post_init__(self) -> None:
        if not 0 <= self.rel_tol < 0.1:
            raise ValueError("rel_tol must be in [0, 0.1)")


class ReducedGradState(ReplicaState):
    """Peer index cache and the groups seen agreeing (known replicas)."""

    __slots__ = ()


def detect(frame: StepFrame, state: ReducedGradState, cfg: ReducedGradConfig) -> DetectorOutput:
    """A replica whose reduced gradient norm differs from the majority's."""
    out = DetectorOutput()
    x = frame.m.get("grad_norm_reduced")
    if frame.n == 0 or x is None:
        return out
    idx = state.peers.get(replica_groups(frame))
    # a reduced norm that is not finite on a rank whose own gradient norm is finite
    # (or inf outright): that rank's reduction went wrong, it votes "corrupt"
    local = frame.m.get("grad_norm", np.full(frame.n, np.nan))
    broken = np.isinf(x) | (np.isnan(x) & np.isfinite(local))
    mat = idx.matrix(np.where(np.isfinite(x), x, np.nan))
    finite = np.isfinite(mat)
    n_fin = finite.sum(axis=1)
    hi = np.where(finite, mat, -np.inf).max(axis=1)
    lo = np.where(finite, mat, np.inf).min(axis=1)
    with np.errstate(invalid="ignore"):
        tol = cfg.rel_tol * np.maximum(np.abs(hi), np.abs(lo))
        agree = (n_fin >= 2) & (hi - lo <= tol)
    n_broken = idx.matrix(broken.astype(np.float64), fill=0.0).sum(axis=1) if broken.any() else 0
    if len(state.replicated) < idx.n_groups:
        state.replicated.update(int(k) for k in idx.keys[agree & (n_broken == 0)])
    split = ((n_fin >= 2) & ~agree) | ((n_fin >= 1) & (n_broken > 0))
    for g in np.flatnonzero(split):
        rows = idx.cell_rows(int(g))
        rows = rows[rows < frame.n]
        bad_rows = rows[broken[rows]]
        vals = x[rows]
        ok = np.isfinite(vals)
        rows, vals = rows[ok], vals[ok]
        med = float(np.median(vals))
        same = np.abs(vals - med) <= cfg.rel_tol * abs(med)
        voters = vals.size + bad_rows.size
        key = int(idx.keys[g])
        if int(same.sum()) * 2 > voters and same.sum() >= 2:
            state.replicated.add(key)
            for r in np.concatenate([rows[~same], bad_rows]):
                out.signals.append(_signal(frame, int(r), med, vals, same.sum() / voters))
        elif cfg.report_unattributed and key in state.replicated:
            everyone = frame.rank[np.concatenate([rows, bad_rows])]
            out.signals.append(
                Signal(
                    kind="sdc",
                    ranks=tuple(sorted(int(v) for v in everyone)),
                    detector=NAME,
                    score=float(same.sum() / voters),
                    severity="oneshot",
                    evidence=metric_evidence(
                        "grad_norm_reduced", np.nan, med, vals, reason="no strict majority"
                    ),
                    unattributed=True,
                )
            )
    return out


def _signal(frame: StepFrame, row: int, majority: float, vals: np.ndarray, share) -> Signal:
    value = float(frame.m["grad_norm_reduced"][row])
    return Signal(
        kind="sdc",
        ranks=(int(frame.rank[row]),),
        detector=NAME,
        score=float(share),
        severity="oneshot",
        evidence=metric_evidence(
            "grad_norm_reduced",
            value,
            majority,
            vals,
            rel_diff=num(abs(value - majority) / abs(majority)) if majority else None,
        ),
    )


CONFIG = ReducedGradConfig
STATE = ReducedGradState

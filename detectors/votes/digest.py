"""Parameter digest vote: a replica whose weights differ from its replicas'.

Design notes: docs/detectors.md, "detectors/votes/digest.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.votes.vote import ReplicaState, Vote, replica_groups, vote

__all__ = ["DigestVoteConfig", "DigestVoteState", "detect"]

NAME = "digest_vote"
SHOWN_CHARS = 24  # digest prefix shown in evidence


@dataclass(kw_only=True, slots=True)
class DigestVoteConfig:
    """Settings of the parameter digest vote."""

    # report groups that disagree without a strict majority (no blame) once
    # they have agreed before
    report_unattributed: bool = True
    max_signals_per_step: int = 64  # a step where more disagree is flagged as one signal

    def __post_init__(self) -> None:
        if self.max_signals_per_step < 1:
            raise ValueError("max_signals_per_step must be >= 1")


class DigestVoteState(ReplicaState):
    """Peer index cache and the groups seen unanimous (known replicas)."""

    __slots__ = ()


def detect(frame: StepFrame, state: DigestVoteState, cfg: DigestVoteConfig) -> DetectorOutput:
    """A replica whose parameter digest disagrees with the strict majority of its replicas."""
    out = DetectorOutput()
    if frame.n == 0:
        return out
    idx = state.peers.get(replica_groups(frame))
    mat = idx.matrix_obj(frame.digest)
    same = (mat == mat[:, :1]) | ~idx.valid
    unanimous = same.all(axis=1)
    if len(state.replicated) < idx.n_groups:
        agreed = unanimous & (idx.sizes >= 2) & (mat[:, 0] != None)  # noqa: E711
        agreed &= (idx.matrix(_finite(frame).astype(np.float64), fill=1.0) == 1.0).all(axis=1)
        state.replicated.update(int(k) for k in idx.keys[agreed])
    for g in np.flatnonzero(~unanimous):
        rows = idx.cell_rows(int(g))
        rows = rows[rows < frame.n]
        values = list(frame.digest[rows])
        v = vote(values)
        if not v.split:
            continue
        key = int(idx.keys[g])
        if v.attributable:
            state.replicated.add(key)
            for i in v.minority:
                out.signals.append(_blame(frame, rows, values, int(i), v))
        elif cfg.report_unattributed and key in state.replicated:
            pairs = zip(rows, values, strict=True)
            voters = [int(frame.rank[r]) for r, d in pairs if d is not None]
            out.signals.append(
                Signal(
                    kind="sdc",
                    ranks=tuple(voters),
                    detector=NAME,
                    score=v.top_votes / v.voters,
                    severity="persistent",
                    evidence=_evidence(None, None, values, v, reason="no strict majority"),
                    unattributed=True,
                )
            )
        if len(out.signals) > cfg.max_signals_per_step:
            break
    return out


def _finite(frame: StepFrame) -> np.ndarray:
    """Rows whose step reported no non-finite value. Weights gone NaN hash alike on
    every rank, so shards that never agreed would look replicated on such a step
    (docs/detectors.md, "detectors/votes/digest.py")."""
    ok = np.ones(frame.n, dtype=bool)
    for col in ("nonfinite", "nonfinite_named"):
        x = frame.m.get(col)
        if x is not None:
            ok &= ~(np.nan_to_num(x, nan=0.0) > 0)
    return ok


def _short(d) -> str | None:
    return None if d is None else str(d)[:SHOWN_CHARS]


def _evidence(value, majority, values: list, v: Vote, **extra) -> dict:
    return {
        "metric": "param_digest",
        "value": _short(value),
        "peer_median": _short(majority),
        "peers": [_short(d) for d in values[:16]],
        "history_median": None,
        "votes": [[_short(d), c] for d, c in v.tally[:8]],
        "voters": v.voters,
        **extra,
    }


def _blame(frame: StepFrame, rows: np.ndarray, values: list, i: int, v: Vote) -> Signal:
    return Signal(
        kind="sdc",
        ranks=(int(frame.rank[rows[i]]),),
        detector=NAME,
        score=v.top_votes / v.voters,
        severity="persistent",
        evidence=_evidence(values[i], v.winner, values, v),
    )


CONFIG = DigestVoteConfig
STATE = DigestVoteState

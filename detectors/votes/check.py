"""Replay signature vote: ranks that recomputed the same thing must agree.

``check`` records carry a signature of a piece of work that several ranks
recomputed from the same inputs (``group`` names the set of ranks, ``check``
the piece). Healthy hardware gives identical signatures; a rank whose
signature differs from a strict majority of its group computed wrong
(kind ``sdc``, severity ``oneshot``). Splits without a strict majority are
reported unattributed. Checks are sampled and few, so this votes in Python.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.votes.vote import vote

__all__ = ["CheckVoteConfig", "CheckVoteState", "detect"]

NAME = "check_vote"


@dataclass(kw_only=True, slots=True)
class CheckVoteConfig:
    """Settings of the replay signature vote."""

    report_unattributed: bool = True  # report splits without a strict majority (no blame)
    max_checks_per_step: int = 100_000  # records beyond this in one step are ignored

    def __post_init__(self) -> None:
        if self.max_checks_per_step < 1:
            raise ValueError("max_checks_per_step must be >= 1")


class CheckVoteState:
    """Stateless: each step's checks are voted on their own."""

    __slots__ = ()

    def __init__(self, cfg: CheckVoteConfig | None = None) -> None:
        pass

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        """Nothing to learn."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        """Nothing to restore."""


def detect(frame: StepFrame, state: CheckVoteState, cfg: CheckVoteConfig) -> DetectorOutput:
    """Replay signatures that disagree with the strict majority of their check group."""
    out = DetectorOutput()
    ballots: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for rec in frame.checks[: cfg.max_checks_per_step]:
        try:
            key = (str(rec["check"]), str(rec["group"]))
            ballots[key][int(rec["rank"])] = str(rec["signature"])  # duplicates: last wins
        except (KeyError, TypeError, ValueError):
            continue  # malformed check record: nothing to vote with
    for (check, group), by_rank in sorted(ballots.items()):
        ranks = sorted(by_rank)
        values = [by_rank[r] for r in ranks]
        v = vote(values)
        if not v.split:
            continue
        base = {
            "metric": "check",
            "check": check,
            "group": group,
            "peer_median": v.winner,
            "peers": values[:16],
            "history_median": None,
            "votes": [[s, c] for s, c in v.tally[:8]],
            "voters": v.voters,
        }
        if v.attributable:
            for i in v.minority:
                out.signals.append(
                    Signal(
                        kind="sdc",
                        ranks=(ranks[i],),
                        detector=NAME,
                        score=v.top_votes / v.voters,
                        severity="oneshot",
                        evidence={**base, "value": values[i]},
                    )
                )
        elif cfg.report_unattributed:
            out.signals.append(
                Signal(
                    kind="sdc",
                    ranks=tuple(ranks),
                    detector=NAME,
                    score=v.top_votes / v.voters,
                    severity="oneshot",
                    evidence={**base, "value": None, "reason": "no strict majority"},
                    unattributed=True,
                )
            )
    return out


CONFIG = CheckVoteConfig
STATE = CheckVoteState

"""Majority vote among replicas that must agree exactly.

Healthy replicas of one shard hold bit-identical parameters, reduced
gradients and replay signatures, so any disagreement is corruption somewhere.
Who is corrupt is decided by votes: a value held by a strict majority (more
than half of the voters, and at least two of them) is the truth and the
others are attributed. Without a strict majority (two replicas that
disagree, a 2-2 split) the disagreement is reported but blamed on nobody.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from rankscope.detectors.stats.peers import PeerCache

__all__ = ["Vote", "vote", "ReplicaState", "replica_groups"]


@dataclass(slots=True)
class Vote:
    """Outcome of one vote over ``voters`` values (None values do not vote)."""

    voters: int
    top_votes: int
    winner: object = None  # the value a strict majority holds, else None
    minority: list[int] = field(default_factory=list)  # positions disagreeing with the winner
    tally: list[tuple[object, int]] = field(default_factory=list)  # most common first

    @property
    def split(self) -> bool:
        """Values disagree."""
        return len(self.tally) > 1

    @property
    def attributable(self) -> bool:
        return self.winner is not None


def replica_groups(frame) -> np.ndarray:
    """Groups of ranks that must hold identical parameters: the peer group, split by
    ``shard`` where ranks report one (FSDP2/HSDP: only equal shards are replicas)."""
    shard = frame.m.get("shard")
    if shard is None or not np.isfinite(shard).any():
        return frame.group
    s = np.where(np.isfinite(shard), shard, -1).astype(np.int64) + 1
    key = np.asarray(frame.group, dtype=np.int64) * (int(s.max()) + 1) + s
    return np.unique(key, return_inverse=True)[1].astype(np.int64).reshape(-1)


def vote(values: list) -> Vote:
    """Vote over ``values`` (None = no vote)."""
    present = [v for v in values if v is not None]
    tally = Counter(present).most_common()
    if not tally:
        return Vote(voters=0, top_votes=0)
    top, votes = tally[0]
    out = Vote(voters=len(present), top_votes=votes, tally=tally)
    if votes * 2 > len(present) and votes >= 2:
        out.winner = top
        out.minority = [i for i, v in enumerate(values) if v is not None and v != top]
    return out


class ReplicaState:
    """State of an equality vote: the peer index cache and the peer groups seen
    unanimous at least once (known replicas; a group that never agreed may not
    be replicas at all, e.g. a sharded layout the coordinates do not show)."""

    __slots__ = ("peers", "replicated")

    def __init__(self, cfg=None) -> None:
        self.peers = PeerCache()
        self.replicated: set[int] = set()

    def learn(self, frame, clean_mask) -> None:
        """No baseline: equality needs none."""

    def state_dict(self) -> dict:
        return {"replicated": sorted(self.replicated)}

    def load_state_dict(self, d: dict) -> None:
        self.replicated = {int(g) for g in d.get("replicated", [])}


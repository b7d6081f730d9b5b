"""Which world a job has, decided by the ranks that report, not by any one record.

Every step record claims a ``world``. Taking the last claim (as the assembler
once did) let three records claiming ``world = 2**20`` size every frame of a
job to a million ranks, and a world smaller than the job's hid its other ranks.
Here a claim counts the distinct ranks that made it: a job's world is the claim
a strict majority of its own ranks back (``settled``); until one is, the claim
with the most ranks leads. Once settled, another claim takes over only with a
majority of its own ranks and more ranks than the current one (a job really
resized); records of other claims are refused as a world mismatch. Memory is
one set of rank numbers per claim (at most ``MAX_CLAIMS`` claims), so it grows
with the ranks that report, never with a claimed world.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_CLAIMS", "WorldVote", "keep_world"]

MAX_CLAIMS = 8
"""Distinct worlds remembered per job; records of further claims are refused."""


class WorldVote:
    """The world claims of one job's step records (see the module docstring)."""

    __slots__ = ("world", "settled", "_votes", "_full")

    def __init__(self, world: int = 0, settled: bool = False) -> None:
        self.world = world
        self.settled = settled
        self._votes: dict[int, set[int]] = {}
        self._full = False  # every rank of the settled world has reported: nothing to count

    def agrees(self, world: int) -> bool:
        """True when a record claiming ``world`` needs no counting (the common case)."""
        return self._full and world == self.world

    def add(self, world: int, ranks) -> bool:
        """Count ``ranks`` claiming ``world``; True when their records are accepted."""
        votes = self._votes.get(world)
        if votes is None:
            if len(self._votes) >= MAX_CLAIMS:
                return world == self.world
            votes = self._votes[world] = set()
        votes.update(ranks)
        n = len(votes)
        if world == self.world:
            self.settled = self.settled or n * 2 > world
            self._full = self.settled and n >= world
            return True
        current = len(self._votes.get(self.world, ()))
        if not self.settled:
            if n * 2 > world or n > current or (n == current and world < self.world):
                self._take(world, n)
            return True
        if n * 2 > world and n > current:
            self._take(world, n)
            return True
        return False

    def _take(self, world: int, n: int) -> None:
        self.world = world
        self.settled = n * 2 > world
        self._full = self.settled and n >= world

    def add_rows(self, world: np.ndarray, rank: np.ndarray) -> np.ndarray | None:
        """``add`` for arrays of rows; None when all are accepted, else the accepted mask."""
        if self._full and bool((world == self.world).all()):
            return None
        ok = None
        for w in np.unique(world).tolist():
            sel = world == w
            if not self.add(int(w), rank[sel].tolist()):
                ok = np.ones(world.size, dtype=bool) if ok is None else ok
                ok[sel] = False
        return ok


def keep_world(chunks: list[dict], seen: np.ndarray, world: int):
    """A step's chunks without the rows that claim another world or lie outside it.

    Returns ``(chunks, seen, dropped)``; the same objects when nothing is dropped.
    """
    if not any(bool((c["world"] != world).any()) for c in chunks):
        if seen.size <= world or not seen[world:].any():
            return chunks, seen, 0
    out, dropped = [], 0
    new_seen = np.zeros(world, dtype=bool)
    for c in chunks:
        ok = (c["world"] == world) & (c["rank"] < world)
        n_ok = int(np.count_nonzero(ok))
        dropped += c["rank"].size - n_ok
        if n_ok == 0:
            continue
        if n_ok < c["rank"].size:
            c = {k: (v[ok] if v is not None else None) for k, v in c.items()}
        new_seen[c["rank"]] = True
        out.append(c)
    return out, new_seen, dropped

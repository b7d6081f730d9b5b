"""A straggler held at its factor over its peers, as a slow GPU would be.

On a host with fewer cores than ranks, a sleep of ``factor - 1`` times a
rank's clean compute is partly given back: while the rank sleeps its peers
get the cores, and when they block in the next collective the sleeper gets
them back, so its compute grows by less than the sleep. Measured on the
bench (4 ranks, 2 cores), "1.25x" sleeps came to 1.05-1.5x of the peers'
compute, "1.5x" to 1.3-3x. A slow GPU slows its rank alone, by its factor.

``held`` faults therefore steer the sleep: every rank posts its compute of
each step on a board (a small file all ranks of the host map, bench
plumbing only, nothing the traces see), and the faulty rank, after each
faulty step, moves its sleep by half the gap between ``factor`` times its
peers' recent median compute and its own. The peers are the ranks of its
symmetric group (same coordinates but ``dp``). The step-to-step noise is the
host's: the target is a median over the last ``REF_STEPS`` steps, and the
sleep moves by half a step's gap, so no step's jitter is undone.
"""

from __future__ import annotations

import mmap
import os
from collections import deque

__all__ = ["Board", "HeldSleep", "peer_key"]

REF_STEPS = 8  # peers' recent compute: median over this many steps
GAIN = 0.5  # share of a step's gap the sleep moves by
MAX_SLEEP = 4.0  # times factor x the clean compute: a bound if the host stalls


class Board:
    """Per rank, (peer key, last step's compute): float64 pairs in a shared file."""

    def __init__(self, path: str, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        size = world * 16
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._view = memoryview(self._map).cast("d")

    def post(self, key: int, compute: float) -> None:
        self._view[2 * self.rank], self._view[2 * self.rank + 1] = float(key), compute

    def peers(self, key: int) -> list[float]:
        """The latest compute of the other ranks with peer key ``key`` (0: none yet)."""
        v = self._view
        return [v[2 * r + 1] for r in range(self.world)
                if r != self.rank and v[2 * r] == key and v[2 * r + 1] > 0]  # fmt: skip

    def close(self) -> None:
        self._view.release()
        self._map.close()


def peer_key(topology, rank: int) -> int:
    """A number equal on the ranks of one symmetric group: the rank's coordinates on
    the mesh's non-dp dimensions (0 without a mesh: every rank is a peer)."""
    if topology is None:
        return 0
    key = 0
    for i, name in enumerate(topology.mesh_dim_names or ()):
        if not name.startswith("dp"):
            key = key * 64 + topology.get_local_rank(i) + 1
    return key


class HeldSleep:
    """The faulty rank's sleep, steered to ``factor`` x its peers' recent compute."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.sleep_s: float | None = None
        self.cap = 0.0
        self.ref: deque[float] = deque(maxlen=REF_STEPS)

    def start(self, clean_s: float) -> None:
        if self.sleep_s is None:
            self.sleep_s = (self.factor - 1.0) * clean_s
            self.cap = MAX_SLEEP * self.factor * clean_s

    def seen(self, peers: list[float]) -> None:
        if peers:
            self.ref.append(sorted(peers)[len(peers) // 2])

    def steer(self, own_s: float) -> None:
        """After a faulty step: move the sleep by ``GAIN`` of the gap to the target."""
        if self.sleep_s is None or not self.ref:
            return
        target = self.factor * sorted(self.ref)[len(self.ref) // 2]
        self.sleep_s = min(max(0.0, self.sleep_s + GAIN * (target - own_s)), self.cap)

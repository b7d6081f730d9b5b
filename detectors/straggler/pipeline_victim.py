"""Pipeline victims: a stage's slowness leaks into its pipeline partners' step times.

Under pipeline parallelism a rank waits for its partner stages' activations and
gradients. Most of that wait is timed as communication, but not all of it (the
first micro-batch's receive before any forward, the schedule's bookkeeping),
so when one stage slows, the ranks of its pipeline (same coordinates except
``pp``) can look slow too for a step or a few, mostly at the fault's onset and
end. A rank is taken for a victim when a partner of its pipeline is slow at the
same step and has been slow for longer (its slow streak), or as long and by a
larger ratio over its own peers: the cause starts first or leads by more, the
echo follows. The standing comes first so that a step's jitter cannot swap
cause and echo in the middle of a fault. Two real faults in one pipeline at
once are rare; the first is still named, and the other once it is gone.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame

__all__ = ["pipeline_victims"]

_OTHER_COORDS = ("dp", "tp", "cp", "ep")
_BLOCK = 1024  # rows compared with all others at once (a block x rows boolean matrix)


def pipeline_victims(
    frame: StepFrame, hit: np.ndarray, rel: np.ndarray, standing: np.ndarray
) -> np.ndarray:
    """Rows among ``hit.any(axis=0)`` whose pipeline partner is hit and ranks above them.

    ``hit`` is (metrics, rows) of slow readings; ``rel`` (rows) each row's largest
    ratio to its peers' median among its slow metrics; ``standing`` (rows) its
    slow streak before this step.
    """
    rows = np.flatnonzero(hit.any(axis=0))
    out = np.zeros(frame.n, dtype=bool)
    pp = frame.coords.get("pp")
    if rows.size < 2 or pp is None or np.unique(pp[rows]).size < 2:
        return out
    key = np.stack([frame.coords[c] for c in _OTHER_COORDS if c in frame.coords], axis=1)
    key, p, st, rl = key[rows], pp[rows], standing[rows], rel[rows]
    # every pair at once, in blocks of rows so that a host's worth of slow rows stays small
    for a in range(0, rows.size, _BLOCK):
        b = slice(a, a + _BLOCK)
        partner = p[b, None] != p[None, :]
        for j in range(key.shape[1]):
            partner &= key[b, j, None] == key[None, :, j]
        above = (st[None, :] > st[b, None]) | (
            (st[None, :] == st[b, None]) & (rl[None, :] > rl[b, None])
        )
        out[rows[b]] = (partner & above).any(axis=1)
    return out

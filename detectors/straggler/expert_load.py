"""A lead that is the rank's experts' share of the tokens: busy, not slow.

Under expert parallelism each rank computes for the tokens the router sent its
experts, and the router need not be fair: early in training, without a
balance loss, or with a popular expert, one rank's experts take far more than
their share, step after step, and the rank computes 1.2-1.3x its peers (the
bench's skewed `moe` runs: all six named `window` straggler observes for the
whole run). Its hardware is fine: evicting it moves the experts, not the load.

The tokens travel by all-to-all, so the rank's all-to-all volume (the bytes of
its ``alltoall`` collectives this step, the counts' exchange a rounding error)
measures its load: those runs read 1.7-2.3x the group median on the loaded
rank. The volume also carries what every rank moves alike (each token goes
there and back), so its excess is about half the load's: a rank whose volume
is at least ``min_ratio`` its group's median, with an excess at least half its
compute lead's, is busy that step. It is not named, and its step is left out
of the windows (no reading, for or against). A slow device moves no more tokens than its
peers: in 48 clean balanced `moe` runs the volume ratio was under 1.1 in 97 %
of rank-steps and never reached 1.25, so a straggler's lead is seldom
covered. The favoured rank's own device can fail too: a rank that computes
``history_ratio`` (1.25) over its own clean median is not excused, whatever
its load (a 1.5x straggler on the favoured rank was missed in 8 of 8 runs
without this). Without all-to-alls nothing changes.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.stats.consensus import Consensus, peer_consensus
from rankscope.detectors.stats.peers import PeerIndex

__all__ = ["expert_busy", "alltoall_volume"]


def alltoall_volume(frame: StepFrame) -> np.ndarray:
    """Per row, the bytes of its ``alltoall`` collectives this step (NaN: none)."""
    return frame.memo("alltoall_volume", _volume)


def _volume(frame: StepFrame) -> np.ndarray:
    out = np.full(frame.n, np.nan)
    for row, colls in enumerate(frame.collectives or ()):
        total = 0.0
        for c in colls or ():
            b = c.get("bytes") if isinstance(c, dict) and c.get("op") == "alltoall" else None
            if isinstance(b, (int, float)) and b > 0:
                total += float(b)
        if total > 0:
            out[row] = total
    return out


def expert_busy(frame: StepFrame, idx: PeerIndex, c: Consensus, i: int, cfg, history
                ) -> np.ndarray:  # fmt: skip
    """Rows whose lead on metric ``i`` its all-to-all volume accounts for and that are not
    slow for themselves (``history``: the ranks' own clean readings; see the module)."""
    busy = np.zeros(frame.n, dtype=bool)
    if not frame.collectives:
        return busy
    vol = alltoall_volume(frame)
    if np.count_nonzero(np.isfinite(vol)) < 2:
        return busy
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = vol / peer_consensus(idx, vol).median[0]
        lead = c.x[i] / c.median[i]
        busy = (lead > 1.0) & (ratio >= cfg.min_ratio) & (ratio - 1.0 >= 0.5 * (lead - 1.0))
    if busy.any():  # a loaded rank that also slowed down against its own past is slow
        count, own = history.median(frame.rank, cfg.metrics[i])
        with np.errstate(invalid="ignore"):
            risen = (count >= cfg.history_min_steps) & (c.x[i] >= cfg.history_ratio * own)
        busy &= ~risen
    return busy

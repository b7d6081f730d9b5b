"""A lead that is the peers' doing: they got faster, the rank did not get slower.

On a shared host a fault elsewhere changes everyone's compute: a rank that sleeps
in its comm thread (a slow link) frees a core, its peers compute faster, and the
one rank that did not gain leads them all (the slow-link bench runs named rank 0,
its compute at its own clean median or a little over, the others' 30-50% below theirs). A
straggler is a rank that slowed down: when its group's median fell below
``1 / min_ratio`` of their clean histories and the rank's own slowdown over its
history is less than half its lead over the group (in log terms) and under
``min_ratio``, it is not named: most of the lead is the peers' speed-up. A rank
that did slow down by ``min_ratio`` over its own history is named all the same
(a straggler that sleeps also frees a core: in the AMP bench runs it read 1.18x
its history with a 1.39x lead). Ranks without a history (slow from the start) are
judged against their peers only, as before.

A rank its peers waited for in the step's collectives (the last to arrive, by at
least ``lead_wait_frac`` of its excess compute) is the step's bottleneck whatever
the host did, and is not excused: when the rest of a crowded host speeds up (a
neighbour's job ends) a real straggler that kept its own pace reads as sped-up
peers. The slow link's bystander is not awaited: the link arrives later than it.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.network.waits import collective_waits
from rankscope.detectors.stats.consensus import Consensus, excess_floor_s, peer_consensus
from rankscope.detectors.stats.peers import PeerIndex

__all__ = ["peers_sped_up"]


def peers_sped_up(frame: StepFrame, idx: PeerIndex, c: Consensus, state, i: int, cfg
                  ) -> np.ndarray:  # fmt: skip
    """Rows whose slowness on metric ``i`` is explained by faster peers (see the module)."""
    count, hmed = state.history.median(frame.rank, cfg.metrics[i])
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(count >= cfg.history_min_steps, c.x[i] / hmed, np.nan)
        group = peer_consensus(idx, rel).median[0]
        lead = c.x[i] / c.median[i]
        # its own slowdown is less than half its lead (in log terms: the peers' part is
        # more) and not a slowdown of its own
        sped = (rel * rel < lead) & (rel < cfg.min_ratio) & (group < 1.0 / cfg.min_ratio)
    if sped.any() and frame.collectives:
        awaited = collective_waits(frame, floor_s=excess_floor_s(frame, cfg)).awaited_s
        sped &= ~(awaited >= cfg.lead_wait_frac * (c.x[i] - c.median[i]))
    return sped

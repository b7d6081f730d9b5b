"""Input waits count only where the peers waited them out.

A rank that waits for its input (``data_s``) slows the job only if its peers
then wait for it in the step's collectives: their ``comm_s`` grows by about
its excess. A loader hiccup of a few milliseconds that the step absorbed (a
short batch, a collective the rank reached no later than the others) costs
nothing, and on a crowded host such hiccups come in twos and threes by chance
(two clean 600-step bench runs named one, 4-8 ms against 0.5 ms, with steps
whose peers had not waited it out). Where ``comm_s`` is not reported, nothing is
asked. Design notes: docs/detectors.md, "detectors/straggler/input_wait.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.stats.consensus import Consensus, frame_consensus
from rankscope.detectors.stats.peers import PeerIndex

__all__ = ["waited_out"]


def waited_out(frame: StepFrame, idx: PeerIndex, c: Consensus, slow: np.ndarray, cfg
               ) -> np.ndarray:  # fmt: skip
    """``slow`` (metrics x rows) less the input-wait readings (``cfg.step_share_metrics``)
    whose excess over the peer median the peers did not wait for: their median
    ``comm_s`` over the row's by less than ``cfg.input_wait_frac`` of that excess."""
    judged = [i for i, m in enumerate(cfg.metrics) if m in cfg.step_share_metrics and slow[i].any()]
    comm = frame.m.get("comm_s")
    if not judged or not cfg.input_wait_frac or comm is None or not np.isfinite(comm).any():
        return slow
    waited = frame_consensus(frame, idx, ("comm_s",)).median[0] - comm
    out = slow.copy()
    with np.errstate(invalid="ignore"):
        for i in judged:
            paid = waited >= cfg.input_wait_frac * (c.x[i] - c.median[i])
            out[i] &= paid | ~np.isfinite(waited)
    return out

"""The step assembler's bounds that need a job's state (docs/trace-format.md, "Bounds").

The validation entry (``rankscope.pipeline.traces.validate``) sees one record;
these see the job: a step far past the job's current step, or a ``t`` far past
its clock, was enough for one record to blind a job (every later step "late",
deadlines gone). A far step is held until a majority of the job's ranks back
it (a job that really jumped, e.g. resumed from a later checkpoint) and is
dropped otherwise; at most ``MAX_FAR_STEPS`` unconfirmed ones are open at a
time, so they cannot crowd the real steps out of ``max_pending_steps``.
"""

from __future__ import annotations

import math

import numpy as np
from rankscope.pipeline.engine.step_buffers import JobBuffer, Pending

__all__ = ["MAX_FAR_STEPS", "far_ahead", "too_many_far", "t_far", "t_ahead"]

MAX_FAR_STEPS = 4
"""Unconfirmed open steps far past a job's current step, held at once."""


def far_ahead(j: JobBuffer, p: Pending, limit: int) -> bool:
    """A step more than ``limit`` past the last one built, backed by no majority of ranks."""
    last = j.last_emitted
    return last is not None and p.step - last > limit and p.count * 2 <= j.world


def too_many_far(j: JobBuffer, step: int, limit: int) -> bool:
    """Opening ``step`` would hold more than ``MAX_FAR_STEPS`` unconfirmed far steps."""
    last = j.last_emitted
    if last is None or step - last <= limit:
        return False
    return sum(1 for p in j.pending.values() if far_ahead(j, p, limit)) >= MAX_FAR_STEPS


def t_far(j: JobBuffer, t: np.ndarray, window_s: float) -> np.ndarray | None:
    """Rows whose ``t`` is more than ``window_s`` past the job's clock (for a job with no
    clock yet, past the batch median); None when there are none."""
    ref = j.clock
    if ref == -math.inf:
        if not t.size or np.isnan(t).all():
            return None
        ref = float(np.nanmedian(t))
    with np.errstate(invalid="ignore"):
        far = t - ref > window_s
    return far if far.any() else None


def t_ahead(j: JobBuffer, t, window_s: float) -> bool:
    """One record's ``t`` more than ``window_s`` past the job's clock."""
    return t is not None and j.clock > -math.inf and t - j.clock > window_s

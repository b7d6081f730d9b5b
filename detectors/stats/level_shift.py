"""Where a slow run stepped up: the onset of a fault that came on top of a mild drift.

A change point over "was it slow" (``change_point_back``) finds where a run of
slow readings began. When a rank was a little slow by chance (1.1x for a
dozen steps on a crowded host) and a real fault then came on top, that run
began at the drift, so the finding's onset came before the fault (the
bench's ``varlen`` 1.25x run 38: onset 7, fault 20, named at 20). Inside the
run, the fault is a second, higher level. ``level_shift_back`` looks for it:
the split of the run into a newer and an older part whose means differ most,
in units of their pooled spread; where that difference is clear and large,
the onset moves up to the newer part. A run of one level keeps its onset.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["level_shift_back", "SHIFT_T", "SHIFT_MIN"]

SHIFT_T = 4.0
"""The newer part's mean must exceed the older's by this many of its standard errors
(the best split of a run of one level reaches it in 1.7 % of 8-reading runs, 0.6 %
of 16 and 0.3 % of 32, at 0.15 of noise in log ratio; the onset then errs late)."""
SHIFT_MIN = math.log(1.1)
"""... and by at least this much (log ratio): a step up too small to be a fault of
its own is not one."""
OLDER_MIN = 3  # readings the older part needs for a spread to be measured


def level_shift_back(v: np.ndarray, ok: np.ndarray, back: np.ndarray,
                     t_min: float = SHIFT_T, min_gap: float = SHIFT_MIN) -> np.ndarray:  # fmt: skip
    """Per row of ``v`` (log ratios, newest first; ``ok`` where present): ``back``
    shortened to the newer part of the run where the run's readings stepped up to a
    clearly higher level; else ``back`` as given."""
    out = np.asarray(back, dtype=np.int64).copy()
    for i in range(out.size):
        at = np.flatnonzero(ok[i, : out[i]])  # positions of the run's readings
        n = at.size
        if n < OLDER_MIN + 1:
            continue
        x = v[i, at]
        s = np.arange(1, n - OLDER_MIN + 1)  # readings in the newer part
        c1 = np.cumsum(x)
        c2 = np.cumsum(x * x)
        new_sum, new_sq = c1[s - 1], c2[s - 1]
        old_sum, old_sq = c1[-1] - new_sum, c2[-1] - new_sq
        m_new, m_old = new_sum / s, old_sum / (n - s)
        ss = (new_sq - s * m_new**2) + (old_sq - (n - s) * m_old**2)
        sp = np.sqrt(np.maximum(ss, 0.0) / max(n - 2, 1))
        with np.errstate(invalid="ignore", divide="ignore"):
            t = (m_new - m_old) / (sp * np.sqrt(1.0 / s + 1.0 / (n - s)))
        t = np.where(m_new - m_old >= min_gap, t, -np.inf)
        best = int(np.argmax(t))
        if t[best] >= t_min:
            out[i] = at[s[best] - 1] + 1
    return out

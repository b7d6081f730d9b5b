"""Saving and restoring per-rank rings: ``steps`` x ranks arrays, per-rank arrays and
the set of ranks a rule holds named (``active``).

The straggler rules that keep their last few readings per rank (``pair_gap``,
``slowest_count``) save them as plain JSON lists: booleans as 0/1, the named
ranks as a list of ids. A state saved for another ring length is refused.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dump_rings", "load_rings"]


def dump_rings(obj, rings: tuple[str, ...], flats: tuple[str, ...]) -> dict:
    """``obj``'s ``steps``, its ``rings`` and ``flats`` arrays and its ``active`` ranks."""
    out: dict = {"steps": obj.steps}
    for k in rings + flats:
        a = getattr(obj, k)
        out[k] = (a.astype(np.int8) if a.dtype == bool else a).tolist()
    out["active"] = np.flatnonzero(obj.active).tolist()
    return out


def load_rings(obj, s: dict, label: str, rings: tuple[str, ...], flats: tuple[str, ...]) -> int:
    """Restore what ``dump_rings`` saved into ``obj`` (reset to the saved rank count by
    its ``_reset``); the number of ranks restored (0: nothing was saved)."""
    if not s:
        return 0
    if int(s.get("steps", -1)) != obj.steps:
        raise ValueError(f"{label} state has {s.get('steps')} steps, not {obj.steps}")
    n = len(s["pos"])
    obj._reset(n)
    if not n:
        return 0
    for k in rings:
        a = getattr(obj, k)
        a[:] = np.asarray(s[k], dtype=a.dtype).reshape(obj.steps, n)
    for k in flats:
        a = getattr(obj, k)
        a[:] = np.asarray(s[k], dtype=a.dtype)
    obj.active[np.asarray(s.get("active", []), dtype=np.int64)] = True
    return n

"""Who waited for whom inside one step's collectives (input of the network detector).

Design notes: docs/detectors.md, "detectors/network/waits.py".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from rankscope.detectors.frame import COORD_NAMES, StepFrame

__all__ = ["Waits", "collective_waits"]


@dataclass(slots=True)
class Waits:
    """Per row: max time others waited for it, max time it waited; plus slow instances."""

    awaited_s: np.ndarray
    waited_s: np.ndarray
    awaited_in: np.ndarray  # number of instances in which the row was the awaited one
    awaited_k: np.ndarray  # largest instance (members) in which the row was awaited
    partners: list[set] = field(default_factory=list)  # distinct ranks that waited for it
    # (group name, duration inside: the shortest s, member rows) of every instance,
    # slow or not: the intersection rule needs both
    inside: list[tuple[str, float, np.ndarray]] = field(default_factory=list)
    # group name -> median duration inside of its instances this step (the baseline)
    typical_s: dict[str, float] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)  # each instance's wait for its last member
    # mean over the row's instances of (its t0 - the instance's median t0); NaN without t0
    lateness: np.ndarray = field(default_factory=lambda: np.zeros(0))
    instances: int = 0


def _member_keys(frame: StepFrame) -> dict[str, np.ndarray]:
    """Group name -> per-row key of the coordinates that group's members share."""
    keys: dict[str, np.ndarray] = {}
    coords = {c: np.asarray(frame.coords.get(c, np.zeros(frame.n)), dtype=np.int64)
              for c in COORD_NAMES}
    for name in ("dp", "tp", "pp", "cp", "ep"):
        keys[name] = _mix([coords[c] for c in COORD_NAMES if c != name])
    keys["dp"] = np.asarray(frame.group, dtype=np.int64)
    return keys


def _mix(cols: list[np.ndarray]) -> np.ndarray:
    key = np.zeros_like(cols[0])
    for col in cols:
        key = key * 1_000_003 + col
    return key


def _key_for(name: str, keys: dict[str, np.ndarray], frame: StepFrame) -> np.ndarray | None:
    if name in keys:
        return keys[name]
    parts = name.replace("-", "_").split("_")
    if len(parts) > 1 and all(p in COORD_NAMES for p in parts):
        coords = [np.asarray(frame.coords.get(c, np.zeros(frame.n)), dtype=np.int64)
                  for c in COORD_NAMES if c not in parts]
        keys[name] = _mix(coords) if coords else np.zeros(frame.n, dtype=np.int64)
        return keys[name]
    return None


def collective_waits(frame: StepFrame, *, floor_s: float) -> Waits:
    """Analyse the step's collectives; gaps below ``floor_s`` are not waits."""
    n = frame.n
    out = Waits(
        awaited_s=np.zeros(n),
        waited_s=np.zeros(n),
        awaited_in=np.zeros(n, dtype=np.int64),
        awaited_k=np.zeros(n, dtype=np.int64),
        partners=[set() for _ in range(n)],
        lateness=np.full(n, np.nan),
    )
    if not frame.collectives:
        return out
    late_sum = np.zeros(n)
    late_cnt = np.zeros(n)
    keys = _member_keys(frame)
    inst: dict[tuple, list[tuple[int, float, float]]] = defaultdict(list)
    for row, colls in enumerate(frame.collectives):
        if not colls:
            continue
        for c in colls:
            try:
                name = str(c["group"])
                seq = int(c["seq"])
            except (KeyError, TypeError, ValueError):
                continue
            mk = _key_for(name, keys, frame)
            member = int(mk[row]) if mk is not None else 0
            s = c.get("s")
            t0 = c.get("t0")
            s = np.nan if s is None else float(s)
            t0 = np.nan if t0 is None else float(t0)
            inst[(name, member, seq)].append((row, s, t0))
    by_name: dict[str, list[float]] = defaultdict(list)
    for (name, _, _), members in inst.items():
        if len(members) < 2:
            continue
        out.instances += 1
        rows = np.array([m[0] for m in members], dtype=np.int64)
        s = np.array([m[1] for m in members])
        t0 = np.array([m[2] for m in members])
        inside_s = float(np.nanmin(s)) if np.isfinite(s).any() else np.nan
        if np.isfinite(inside_s):
            by_name[name].append(inside_s)
            out.inside.append((name, inside_s, rows))
        if np.isfinite(t0).all():
            late_sum[rows] += t0 - np.median(t0)
            late_cnt[rows] += 1
        a, gap, excess = _awaited(s, t0, floor_s)
        out.gaps.append(max(gap, 0.0))
        if a < 0:
            continue
        out.awaited_s[rows[a]] = max(out.awaited_s[rows[a]], gap)
        out.awaited_in[rows[a]] += 1
        out.awaited_k[rows[a]] = max(out.awaited_k[rows[a]], rows.size)
        others = np.arange(rows.size) != a
        np.maximum.at(out.waited_s, rows[others], excess[others])
        out.partners[rows[a]].update(int(r) for r in frame.rank[rows[others]])
    out.typical_s = {name: float(np.median(v)) for name, v in by_name.items()}
    with np.errstate(invalid="ignore", divide="ignore"):
        out.lateness = np.where(late_cnt > 0, late_sum / late_cnt, np.nan)
    return out


def _awaited(s: np.ndarray, t0: np.ndarray, floor_s: float) -> tuple[int, float, np.ndarray]:
    """(member everyone waited for or -1, how long they waited, each member's excess wait).

    The wait is returned even when it is too short to name anyone: its size in
    ordinary steps is the job's arrival noise.
    """
    have_s = np.isfinite(s).all()
    if np.isfinite(t0).all():
        a = int(np.argmax(t0))
        others = np.delete(t0, a)
        gap = float(t0[a] - np.median(others))
        excess = t0[a] - t0
        if gap <= floor_s:
            return -1, gap, excess
        if have_s:  # a late arriver waits least; a clock running ahead does not
            gap_s = float(np.median(np.delete(s, a)) - s[a])
            if gap_s < 0.5 * gap:
                return -1, gap_s, excess
        return a, gap, excess
    if not have_s:
        return -1, 0.0, np.zeros_like(s)
    a = int(np.argmin(s))
    gap = float(np.median(np.delete(s, a)) - s[a])
    excess = s - s[a]
    if gap > floor_s:
        return a, gap, excess
    return -1, gap, excess

"""Which group is which, when collectors name groups by axis.

Design notes: docs/hangs.md, "detectors/hang/groups.py".
"""

from __future__ import annotations

from rankscope.detectors.hang.state import Job
from rankscope.detectors.hang.wait_graph import RankView

__all__ = ["instance_namer", "axis_groups"]


def instance_namer(j: Job, rank: int):
    """Collectors name groups by axis (``dp``, ``tp``): one name, many groups. With
    the rank's coordinates known, ``dp`` becomes ``dp@pp=0,tp=1``: the ranks that
    share every other coordinate. Declared groups keep their names."""
    coords = j.coords.get(rank)
    axes = dict(coords) if coords else {}

    def name(g: str | None) -> str | None:
        if g is None or g not in axes or g in j.groups:
            return g
        return g + "@" + ",".join(f"{a}={v}" for a, v in coords if a != g)

    return name


def axis_groups(j: Job, views: dict[int, RankView]) -> dict[str, set[int]]:
    """Members of the axis-named group instances the views mention, from coordinates."""
    wanted = {g for v in views.values() for g in (v.head_group, *v.entered) if g and "@" in g}
    if not wanted:
        return {}
    out: dict[str, set[int]] = {g: set() for g in wanted}
    axes = {g.split("@", 1)[0] for g in wanted}
    for r in j.coords:
        name = instance_namer(j, r)
        for a in axes:
            g = name(a)
            if g in out:
                out[g].add(r)
    return out

"""Clocks for the hang monitor: per-rank offsets from step boundaries, and a common "now".

Design notes: docs/hangs.md, "detectors/hang/clock.py".
"""

from __future__ import annotations

import statistics

from rankscope.detectors.hang.state import Job, Rank

__all__ = ["clock_offsets", "now_corrected", "since", "silent_s"]


def clock_offsets(boundaries: dict[int, dict[int, float]]) -> dict[int, float]:
    """Rank -> seconds its clock runs ahead of the median rank's (step -> rank -> arrival)."""
    devs: dict[int, list[float]] = {}
    for seen in boundaries.values():
        if len(seen) < 2:
            continue
        mid = statistics.median(seen.values())
        for r, a in seen.items():
            devs.setdefault(r, []).append(a - mid)
    return {r: statistics.median(d) for r, d in devs.items()}


def now_corrected(j: Job, now: float, offsets: dict[int, float]) -> float:
    """``now`` on the corrected clock: the newest corrected arrival plus the caller's
    lead over the newest raw arrival (never negative; with zero offsets: ``now``)."""
    if not j.ranks:
        return now
    newest = max(rs.last_arrival for rs in j.ranks.values())
    newest_c = max(rs.last_arrival - offsets.get(r, 0.0) for r, rs in j.ranks.items())
    return newest_c + max(0.0, now - newest)


def since(j: Job, offsets: dict[int, float]) -> float:
    """Corrected arrival of the newest progress (of the first beat when there was none).

    A step end the caller did not stamp carries the frame time, the latest
    rank's clock, so the largest offset is taken out of it.
    """
    marks = []
    if j.last_progress is not None:
        arrival, r = j.last_progress
        marks.append(arrival - offsets.get(r, 0.0))
    if j.last_step_end is not None:
        arrival, stamped = j.last_step_end
        marks.append(arrival if stamped else arrival - max(offsets.values(), default=0.0))
    return max(marks) if marks else j.first_arrival


def silent_s(rs: Rank, now_c: float, offsets: dict[int, float]) -> float:
    """Seconds since the rank's newest beat, on the corrected clock."""
    return now_c - (rs.last_arrival - offsets.get(rs.rank, 0.0))

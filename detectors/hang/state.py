"""The hang monitor's per-job and per-rank memory, and its plain-dict form.

Kept apart from the logic in ``detectors/hang/monitor.py`` so that what a restarted
service must remember is visible in one place: for each rank, its newest beat
(what it does now) plus the highest sequence number it entered and finished
per group; for each job, group memberships, recent step durations and the
step boundaries the clock offsets come from.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

__all__ = ["Rank", "Job", "is_closed", "job_to_dict", "job_from_dict"]


@dataclass(slots=True)
class Rank:
    rank: int
    host: str | None = None
    last_t: float = float("-inf")  # record time of the newest beat (own clock)
    last_arrival: float = float("-inf")
    phase: str | None = None
    busy_phase: str | None = None  # last phase other than idle (what it did before closing)
    step: int | None = None
    step_t: float | None = None  # own-clock time the current step was first seen
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    done: bool | None = None
    peer: int | None = None
    entered: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    gaps: deque = field(default_factory=deque)


@dataclass(slots=True)
class Job:
    ranks: dict[int, Rank] = field(default_factory=dict)
    groups: dict[str, set[int]] = field(default_factory=dict)
    world: int | None = None
    first_arrival: float | None = None
    # newest step advance seen in beats: (arrival, rank) so its clock offset can be removed
    last_progress: tuple[float, int] | None = None
    # newest assembled step end: (arrival, caller stamped it); an unstamped frame time
    # is the latest rank's clock, so the largest offset is removed from it
    last_step_end: tuple[float, bool] | None = None
    step_end: tuple[int, float] | None = None  # (step, t) of the last step end seen
    durations: deque = field(default_factory=deque)
    reported: tuple | None = None
    # step -> {rank: arrival of its first beat in that step}: the clock-offset samples
    boundaries: dict[int, dict[int, float]] = field(default_factory=dict)
    # rank -> ((axis, coordinate), ...) from assembled steps: tells which "dp" is whose
    coords: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    offsets: dict[int, float] | None = None  # cache of clock_offsets(boundaries)
    offsets_age: int = 0  # new step boundaries since the cache was computed
    n_closed: int = 0  # ranks whose newest beat is the final one (is_closed)


def is_closed(rs: Rank) -> bool:
    """The collector's final beat at close: ``idle`` after having run collectives."""
    return rs.phase == "idle" and bool(rs.entered)


def _rank_to_dict(rs: Rank) -> dict:
    d = {f.name: getattr(rs, f.name) for f in fields(Rank)}
    d["gaps"] = list(rs.gaps)
    d["entered"], d["finished"] = dict(rs.entered), dict(rs.finished)
    return d


def job_to_dict(j: Job) -> dict:
    """JSON-able form of one job's state (tuples as lists, int keys as strings)."""
    return {
        "ranks": {str(r): _rank_to_dict(rs) for r, rs in j.ranks.items()},
        "groups": {g: sorted(m) for g, m in j.groups.items()},
        "world": j.world,
        "first_arrival": j.first_arrival,
        "last_progress": list(j.last_progress) if j.last_progress else None,
        "last_step_end": list(j.last_step_end) if j.last_step_end else None,
        "step_end": list(j.step_end) if j.step_end else None,
        "durations": list(j.durations),
        "reported": [list(x) for x in j.reported] if j.reported else None,
        "coords": {str(r): [list(x) for x in c] for r, c in j.coords.items()},
        "boundaries": {
            str(st): {str(r): a for r, a in seen.items()} for st, seen in j.boundaries.items()
        },
    }


def _tuple(x):
    return tuple(x) if x else None


def job_from_dict(d: dict, step_window: int, beat_window: int) -> Job:
    j = Job(
        groups={g: set(m) for g, m in d["groups"].items()},
        world=d["world"],
        first_arrival=d["first_arrival"],
        last_progress=_tuple(d["last_progress"]),
        last_step_end=_tuple(d["last_step_end"]),
        step_end=_tuple(d["step_end"]),
        durations=deque(d["durations"], maxlen=step_window),
        reported=tuple(tuple(x) for x in d["reported"]) if d["reported"] else None,
        coords={int(r): tuple((a, v) for a, v in c) for r, c in d.get("coords", {}).items()},
        boundaries={
            int(st): {int(r): a for r, a in seen.items()} for st, seen in d["boundaries"].items()
        },
    )
    for r, rd in d["ranks"].items():
        rd = dict(rd)
        gaps = deque(rd.pop("gaps"), maxlen=beat_window)
        j.ranks[int(r)] = Rank(gaps=gaps, **rd)
    j.n_closed = sum(is_closed(rs) for rs in j.ranks.values())
    return j

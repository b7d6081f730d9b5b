"""Who waited for whom inside one step's collectives (input of the network detector).

Design notes: docs/detectors.md, "detectors/network/waits.py".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from rankscope.detectors.frame import COORD_NAMES, StepFrame

__all__ = ["Waits", "axis_key", "collective_waits", "collective_instances", "held_after_others"]


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
    # mean over the same instances of how far into its members' work each came (0: at
    # the step's start, 1: after all of it; NaN: unknown): how much of a rank's own
    # extra work its lateness there can hold
    reach: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the longest the row stayed inside one symmetric collective after every other member
    # had returned from it (``t0 + s``); NaN where no instance had every member's times
    held_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per row: its waits in point-to-point transfers this step, summed (a pipeline stage
    # blocked in a receive for its upstream neighbour arrives late at its own collectives)
    p2p_waited_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
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


def axis_key(frame: StepFrame, axis: str) -> np.ndarray:
    """Per row, a key equal on the members of one group of mesh ``axis`` (``dp``:
    the peer group; else equal in every coordinate but ``axis``)."""
    return _member_keys(frame)[axis]


def _mix(cols: list[np.ndarray]) -> np.ndarray:
    key = np.zeros_like(cols[0])
    for col in cols:
        key = key * 1_000_003 + col
    return key


# device-mesh dimension names (torchtitan, FSDP/HSDP) that name a group of one axis;
# every stage of a pipeline has its own group of the same name
_MESH_AXES = {
    "dp_replicate": "dp", "replicate": "dp", "ddp": "dp", "hsdp": "dp",
    "dp_shard": "dp", "shard": "dp", "fsdp": "dp", "data": "dp", "data_parallel": "dp",
    "tensor": "tp", "tensor_parallel": "tp", "pipeline": "pp", "pipeline_parallel": "pp",
    "context": "cp", "expert": "ep",
}  # fmt: skip
# under HSDP a replicate group holds one shard of every replica, a shard group one replica
_REPLICATE, _SHARD = {"dp_replicate", "replicate"}, {"dp_shard", "shard"}
# a transfer between ranks, not a collective everyone waits in for its last member: a
# rank blocked in one waited (a victim), and a slow one is slow inside, but it names no
# one late (pipeline schedules' sequence numbers need not pair a send with its receive)
POINT_TO_POINT = frozenset({"send", "recv", "p2p"})
# every member returns once the last contribution is in: no root that may leave first
SYMMETRIC = frozenset({"allreduce", "allgather", "reduce_scatter", "alltoall", "barrier"})


def _key_for(name: str, keys: dict[str, np.ndarray], frame: StepFrame) -> np.ndarray | None:
    if name in keys:
        return keys[name]
    axis = _MESH_AXES.get(name)
    if axis is not None:
        keys[name] = _mesh_key(name, keys[axis], frame)
        return keys[name]
    parts = name.replace("-", "_").split("_")
    if len(parts) > 1 and all(p in COORD_NAMES for p in parts):
        coords = [np.asarray(frame.coords.get(c, np.zeros(frame.n)), dtype=np.int64)
                  for c in COORD_NAMES if c not in parts]
        keys[name] = _mix(coords) if coords else np.zeros(frame.n, dtype=np.int64)
        return keys[name]
    return None


def _mesh_key(name: str, base: np.ndarray, frame: StepFrame) -> np.ndarray:
    """Members of a mesh-dimension group: equal in the axis's other coordinates and,
    under HSDP, in their ``shard`` (a replicate group) or their replica (a shard group:
    ``dp - shard``, dp numbering replicas outer as the collector does)."""
    shard = frame.m.get("shard")
    if shard is None or not np.isfinite(shard).any() or name not in _REPLICATE | _SHARD:
        return base
    sh = np.nan_to_num(shard, nan=0.0).astype(np.int64)
    if name in _SHARD:
        sh = np.asarray(frame.coords.get("dp", np.zeros(frame.n)), dtype=np.int64) - sh
    return _mix([base, sh])


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
        reach=np.full(n, np.nan),
        held_s=np.full(n, np.nan),
        p2p_waited_s=np.zeros(n),
    )
    if not frame.collectives:
        return out
    late_sum = np.zeros(n)
    late_cnt = np.zeros(n)
    reach_sum = np.zeros(n)
    start, work = _starts_and_work(frame)
    inst = collective_instances(frame)
    out.held_s = held_after_others(frame).copy()
    by_name: dict[str, list[float]] = defaultdict(list)
    for (name, _, _), members in inst.items():
        if len(members) < 2:
            continue
        rows = np.array([m[0] for m in members], dtype=np.int64)
        s = np.array([m[1] for m in members])
        t0 = np.array([m[2] for m in members])
        out.instances += 1
        inside_s = float(np.nanmin(s)) if np.isfinite(s).any() else np.nan
        p2p = any(m[3] in POINT_TO_POINT for m in members)
        rooted = not p2p and not all(m[3] in SYMMETRIC for m in members)
        if rooted:
            # a root's members leave as soon as their own part is done (a broadcast's
            # receivers while the root still waits for a late one): its duration inside
            # is no link's, but a member held longer than the quickest one waited
            if np.isfinite(s).all():
                np.maximum.at(out.waited_s, rows, s - inside_s)
        elif np.isfinite(inside_s):
            by_name[name].append(inside_s)
            out.inside.append((name, inside_s, rows))
        if p2p:
            a, _, excess = _awaited(s, t0, floor_s)
            if a >= 0:
                others = np.arange(rows.size) != a
                np.maximum.at(out.waited_s, rows[others], excess[others])
                np.add.at(out.p2p_waited_s, rows[others], np.maximum(excess[others], 0.0))
            continue
        if np.isfinite(t0).all():
            late_sum[rows] += t0 - np.median(t0)
            late_cnt[rows] += 1
            reach_sum[rows] += _reach(t0, start[rows], work[rows])
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
        out.reach = np.where(late_cnt > 0, reach_sum / late_cnt, np.nan)
    return out


def _starts_and_work(frame: StepFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per row: when its step began (``t`` - ``step_s``) and its own work (compute +
    input), NaN where the record lacks them."""
    nan = np.full(frame.n, np.nan)
    m = frame.m
    start = m.get("t", nan) - m.get("step_s", nan)
    work = m.get("compute_s", nan) + np.nan_to_num(m.get("data_s", nan), nan=0.0)
    return start, work


def _reach(t0: np.ndarray, start: np.ndarray, work: np.ndarray) -> float:
    """How far into the members' work one collective came: the median time from their
    step's start to their arrival over their median work, in [0, 1]. A collective at
    the start of the step (a GradScaler's check, a loss all-reduce) holds none of a
    rank's extra compute; DDP's last bucket nearly all of it. NaN where unknown."""
    since = t0 - start
    if not (np.isfinite(since).all() and np.isfinite(work).all()):
        return np.nan
    total = float(np.median(work))
    return float(np.clip(np.median(since) / total, 0.0, 1.0)) if total > 0 else np.nan


Instances = dict[tuple, list[tuple[int, float, float, "str | None"]]]


def collective_instances(frame: StepFrame) -> Instances:
    """(group name, member key, seq) -> [(row, s, t0, op)] of the step's collectives,
    once per frame (the network and straggler detectors both read it)."""
    return frame.memo("collective_instances", _group_instances)


def _group_instances(frame: StepFrame) -> Instances:
    keys = _member_keys(frame)
    inst: Instances = defaultdict(list)
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
            inst[(name, member, seq)].append((row, s, t0, c.get("op")))
    return inst


def held_after_others(frame: StepFrame) -> np.ndarray:
    """Per row: the longest it stayed inside one symmetric collective after every other
    member had returned (a slow link's own time there, not a wait for anyone); NaN
    where no instance had every member's times. Once per frame."""
    return frame.memo("held_after_others", _held_all)


def _held_all(frame: StepFrame) -> np.ndarray:
    held = np.full(frame.n, np.nan)
    for members in collective_instances(frame).values():
        if len(members) < 2 or not all(m[3] in SYMMETRIC for m in members):
            continue
        s = np.array([m[1] for m in members])
        t0 = np.array([m[2] for m in members])
        if np.isfinite(s).all() and np.isfinite(t0).all():
            _held(held, np.array([m[0] for m in members], dtype=np.int64), t0 + s)
    return held


def _held(held: np.ndarray, rows: np.ndarray, end: np.ndarray) -> None:
    """Raise each row's ``held`` to how long it returned after the last of the others."""
    top2 = np.sort(end)[-2:]
    after = end - np.where(end == top2[1], top2[0], top2[1])  # the others' latest return
    held[rows] = np.fmax(held[rows], np.maximum(after, 0.0))


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

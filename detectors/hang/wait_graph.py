"""Who is everyone waiting for? Localizing a hang from collective fingerprints.

Design notes: docs/hangs.md, "detectors/hang/wait_graph.py".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["RankView", "Localization", "localize"]


@dataclass(slots=True)
class RankView:
    """What is known about one rank at the time of the hang.

    ``entered[g]`` / ``done[g]``: highest sequence number of group ``g`` this
    rank is known to have entered / finished. ``head_*``: the collective it is
    blocked in (``blocked`` True), a peer rank for point-to-point ops.
    """

    rank: int
    seen: bool = True
    alive: bool = True
    blocked: bool = False
    head_group: str | None = None
    head_seq: int | None = None
    head_peer: int | None = None
    head_op: str | None = None
    entered: dict[str, int] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Localization:
    """The verdict: culprits (alive, stuck outside or locally), crashed, and why."""

    hang: list[int] = field(default_factory=list)
    crash: list[int] = field(default_factory=list)
    waiting: dict[int, list[int]] = field(default_factory=dict)
    unattributed: list[int] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)

    @property
    def culprits(self) -> list[int]:
        return sorted(set(self.hang) | set(self.crash))


def _has_entered(view: RankView | None, group: str, seq: int) -> bool:
    if view is None or not view.seen:
        return False
    if view.head_group == group and view.head_seq is not None and view.head_seq >= seq:
        return True
    return view.entered.get(group, -1) >= seq or view.done.get(group, -1) >= seq


def _judge_head(views, group_members, g: str, n: int) -> tuple[str, list[int]]:
    """What holds collective (g, n) up, for any member blocked in it.

    ``("wait", ranks)``: members that never entered it, or (everyone entered,
    nobody finished) members blocked on an older op of their own;
    ``("local", [])``: some member already finished it; ``("stuck", [])``:
    everyone is in it and nobody finishes.
    """
    absent = [s for s in group_members if not _has_entered(views.get(s), g, n)]
    if absent:
        return "wait", absent
    present = [views[s] for s in group_members if s in views]
    if any(pv.done.get(g, -1) >= n for pv in present):
        return "local", []
    # Everyone entered and nobody finished: members blocked on an older
    # collective of their own hold this one up (stream order).
    elsewhere = [pv.rank for pv in present if pv.blocked and (pv.head_group, pv.head_seq) != (g, n)]
    return ("wait", elsewhere) if elsewhere else ("stuck", [])


def localize(
    views: Mapping[int, RankView],
    groups: Mapping[str, Iterable[int]],
) -> Localization:
    """Build the wait-for graph of the blocked ranks and classify its sinks.

    ``groups`` maps a group name to its member ranks, as declared; a group
    with no declared members is taken to be the ranks that reported entering
    it plus every rank that never reported (nothing excludes them).
    ``views`` must hold every rank of the job, with ``seen=False`` for ranks
    that never reported.
    """
    members: dict[str, set[int]] = {g: set(m) for g, m in groups.items()}
    unseen = {v.rank for v in views.values() if not v.seen}
    for v in views.values():
        for g in set(v.entered) | set(v.done) | ({v.head_group} - {None}):
            if g not in groups:
                members.setdefault(g, set(unseen)).add(v.rank)

    out = Localization()
    edges: dict[int, list[int]] = {}
    locally_stuck: set[int] = set()
    stuck_together: set[int] = set()
    heads: dict[tuple[str, int], tuple[str, list[int]]] = {}
    for r in sorted(views):
        v = views[r]
        if not (v.seen and v.blocked and v.head_group is not None):
            continue
        if v.head_peer is not None:
            pv = views.get(v.head_peer)
            if (
                pv is not None
                and pv.blocked
                and pv.head_peer == r
                and pv.head_group == v.head_group
            ):
                stuck_together.add(r)  # both sides of the transfer are posted
            elif v.head_peer != r:
                edges[r] = [v.head_peer]
            continue
        if v.head_seq is None:
            continue
        verdict = heads.get((v.head_group, v.head_seq))
        if verdict is None:  # every rank blocked on the same collective shares one answer
            verdict = heads[(v.head_group, v.head_seq)] = _judge_head(
                views, sorted(members.get(v.head_group, ())), v.head_group, v.head_seq
            )
        how, who = verdict
        if how == "wait":
            edges[r] = who
        elif how == "local":
            locally_stuck.add(r)
        else:
            stuck_together.add(r)

    out.waiting = edges
    targets = {s for ws in edges.values() for s in ws}
    sinks = (targets - set(edges) - stuck_together) | locally_stuck
    for s in sorted(sinks):
        v = views.get(s)
        if s in locally_stuck:
            out.hang.append(s)
            out.reasons[s] = (
                f"blocked in {v.head_group}#{v.head_seq} ({v.head_op or 'collective'}) that "
                "its peers already finished: its own device or stream is stuck"
            )
        elif v is None or not v.seen:
            out.crash.append(s)
            out.reasons[s] = "others wait for it and it never reported"
        elif not v.alive:
            out.crash.append(s)
            out.reasons[s] = "others wait for it and it stopped reporting"
        else:
            out.hang.append(s)
            out.reasons[s] = "others wait for it in a collective it never entered"

    # Waiting ranks from which no sink (nor a stuck collective) can be reached: a cycle.
    waiters: dict[int, list[int]] = {}
    for r, ws in edges.items():
        for w in ws:
            waiters.setdefault(w, []).append(r)
    reach = set(sinks) | stuck_together
    todo = list(reach)
    while todo:
        for r in waiters.get(todo.pop(), ()):
            if r not in reach:
                reach.add(r)
                todo.append(r)
    cyclic = sorted(r for r in edges if r not in reach)
    for r in cyclic:
        out.reasons[r] = "waits in a cycle of ranks that all wait on each other"
    for r in sorted(stuck_together):
        v = views[r]
        what = f"{v.head_group}#{v.head_seq}" if v.head_peer is None else f"{v.head_op}"
        out.reasons[r] = (
            f"every participant entered {what} and none finished it: "
            "the transfer itself is stuck (link or library)"
        )
    out.unattributed = sorted(set(cyclic) | stuck_together)
    return out

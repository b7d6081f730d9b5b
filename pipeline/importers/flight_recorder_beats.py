"""Flight Recorder dumps as a rankscope trace of beats, so ``replay`` localizes the hang.

A dump is a snapshot taken when the watchdog gave up; a live hang looks to
rankscope like beats that keep saying "still in collective (G, N)". So each
rank with a dump becomes, in order:

1. *counter beats* (one per group it belongs to, carrying the member list in
   ``coll_ranks``): the highest sequence number it finished (``coll_done``
   true) and entered in that group;
2. *head beats*, one every ``beat_interval_s`` from the moment the job went
   quiet until the watchdog fired (``timeout_ms``): the op the rank is
   blocked on, i.e. the oldest op it issued and has not finished (a rank's
   ops run in issue order, so later ones wait behind it). Point-to-point ops
   carry ``coll_peer`` (the other rank) instead of a sequence number. A rank
   with nothing in flight beats ``phase: idle``.

A rank without a usable dump writes no beats at all, like a rank that
crashed; ``world`` and the member lists tell the monitor it exists.

Which counters are trusted: ``pg_status`` reports the sequence number of the
last *work* of a group, and point-to-point ops count on their own counter.
So ``pg_status`` is used for a group only when no dump shows a p2p op in it;
otherwise the entries alone say what a rank entered. The step is unknown in
a dump and written as 0 (``steps_known: false`` in meta.json).
"""

from __future__ import annotations

from rankscope.collectors.schema.records import FORMAT_VERSION
from rankscope.pipeline.importers.flight_recorder import DumpReport, RankDump

__all__ = ["dumps_to_records", "rank_counters"]

DEFAULT_SPAN_S = 600.0  # NCCL's default watchdog timeout, when no entry says otherwise
MAX_BEATS_PER_RANK = 1000
"""Beats per rank at most, whatever span a dump's ``timeout_ms`` claims (bounded time)."""


def _p2p_groups(dumps: dict[int, RankDump]) -> set[str]:
    return {o.group for d in dumps.values() for o in d.ops if o.p2p}


def rank_counters(dump: RankDump, p2p_groups: set[str]) -> dict[str, tuple[int | None, int | None]]:
    """Per group: (highest seq entered, highest seq finished) as far as the dump tells."""
    entered: dict[str, int] = {}
    done: dict[str, int] = {}

    def bump(table, g, v):
        if v is not None and v >= 0:
            table[g] = max(table.get(g, -1), v)

    for pg_id, (enq, comp) in dump.status.items():
        g = dump.pg_names.get(pg_id)
        if g is not None and g not in p2p_groups:
            bump(entered, g, enq)
            bump(done, g, comp)
    pending_min: dict[str, int] = {}
    for o in dump.ops:
        if o.p2p:
            bump(entered, o.group, o.group_coll_seq)
            continue
        bump(entered, o.group, o.seq)
        if o.done:
            bump(done, o.group, o.seq)
        elif o.seq is not None:
            pending_min[o.group] = min(pending_min.get(o.group, o.seq), o.seq)
    for g, n in pending_min.items():  # ops of one group finish in order
        bump(done, g, n - 1)
    groups = set(entered) | set(done)
    return {g: (entered.get(g), done.get(g)) for g in groups}


def _beat(job: str, rank: int, t: float, **fields) -> dict:
    """A beat record; beside the contract's fields it carries added ones (``world``,
    ``coll_p2p_seq``), which the format allows."""
    rec = {"v": FORMAT_VERSION, "type": "beat", "job": job, "rank": rank, "host": f"rank{rank}"}
    rec.update(t=round(t, 6), step=0)
    rec.update({k: v for k, v in fields.items() if v is not None})
    return rec


def dumps_to_records(
    dumps: dict[int, RankDump],
    report: DumpReport,
    job: str,
    beat_interval_s: float = 5.0,
    span_s: float | None = None,
) -> tuple[list[dict], dict]:
    """Beat records for every rank with a dump, and the trace's meta.json body."""
    if beat_interval_s <= 0:
        raise ValueError("beat_interval_s should be > 0")
    p2p = _p2p_groups(dumps)
    times = [o.t_ns for d in dumps.values() for o in d.ops if o.t_ns]
    t_quiet = max(times) / 1e9 + 1.0 if times else 0.0
    if span_s is None:
        timeouts = [d.timeout_ms for d in dumps.values() if d.timeout_ms]
        span_s = max(timeouts) / 1000.0 if timeouts else DEFAULT_SPAN_S
    members: dict[str, list[int]] = {}
    for d in dumps.values():
        for g, (_, m) in d.groups.items():
            if m:
                members.setdefault(g, sorted(m))
    records: list[dict] = []
    for r in sorted(dumps):
        d = dumps[r]
        counters = rank_counters(d, p2p)
        mine = [g for g, (_, m) in d.groups.items() if r in m] + sorted(counters)
        for g in dict.fromkeys(mine):
            ent, fin = counters.get(g, (None, None))
            ranks = members.get(g)
            records.append(
                _beat(
                    job,
                    r,
                    t_quiet - 2.0,
                    phase="collective",
                    coll_group=g,
                    coll_seq=fin,
                    coll_done=True if fin is not None else None,
                    coll_ranks=ranks,
                    world=report.world,
                )
            )
            if ent is not None and (fin is None or ent > fin):
                records.append(
                    _beat(
                        job,
                        r,
                        t_quiet - 1.5,
                        phase="collective",
                        coll_group=g,
                        coll_seq=ent,
                        coll_done=False,
                    )
                )
        pending = d.pending
        head = pending[0] if pending else None
        n = min(int(span_s // beat_interval_s) + 1, MAX_BEATS_PER_RANK)
        for i in range(n):
            t = t_quiet + i * beat_interval_s
            if head is None:
                records.append(_beat(job, r, t, phase="idle", world=report.world))
                continue
            records.append(
                _beat(
                    job,
                    r,
                    t,
                    phase="collective",
                    coll_group=head.group,
                    coll_seq=head.seq,
                    coll_op=head.op,
                    coll_done=False,
                    coll_peer=head.peer,
                    coll_p2p_seq=head.p2p_seq,
                    coll_pending=len(pending),
                    world=report.world,
                )
            )
    meta = {
        "job": job,
        "world": report.world,
        "source": "pytorch-flight-recorder",
        "steps_known": False,
        "groups": members,
        "group_desc": {g: desc for d in dumps.values() for g, (desc, _) in d.groups.items()},
        "dumps": {
            "loaded": report.loaded,
            "missing": report.missing,
            "empty": report.empty,
            "refused": report.refused,
            "corrupt": report.corrupt,
            "versions": report.versions,
        },
    }
    return records, meta

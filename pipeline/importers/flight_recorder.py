"""Reading PyTorch Flight Recorder dumps (one pickle per rank) safely and tolerantly.

The NCCL watchdog of a hung job writes each rank's Flight Recorder ring
buffer to a file (``_dump_<rank>``, ``nccl_trace_rank_<rank>``...): a pickled
dict with ``version``, ``pg_config`` (group name -> description and member
ranks), ``pg_status`` (per local group id: last enqueued / started /
completed sequence number) and ``entries`` (collectives in flight or recent:
process group, ``collective_seq_id``, ``profiling_name``, ``state``, sizes,
times). These files are untrusted: they are loaded with
``rankscope.pipeline.importers.safe_unpickle`` (no globals, so no code runs), and every problem
(refused, truncated, not a dump, missing rank, empty entry list) is recorded
in a ``DumpReport`` instead of stopping the import.

What each field means across versions, and the facts this module extracts
per rank (``RankDump``), are documented in ``docs/hangs.md``; the conversion
to beat records lives in ``pipeline/importers/flight_recorder_beats.py``.

Bounded in time and memory (docs/hangs.md, "Limits"): the world comes from
the dumps present and the members their process groups declare, never from
a file name alone (a dump whose name's rank none of the declared groups
holds is refused), and no rank may reach ``MAX_WORLD``; member lists are
parsed by a small bounded parser, never ``ast.literal_eval``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.pipeline.importers.safe_unpickle import (
    MAX_PICKLE_BYTES,
    PickleFormatError,
    UnsafePickleError,
    safe_loads,
)
from rankscope.pipeline.traces.validate import DEFAULT_MAX_WORLD

__all__ = ["Op", "RankDump", "DumpReport", "load_dumps", "parse_dump", "dump_rank_of"]

_RANK_IN_NAME = re.compile(r"(?:^|[_\-.a-zA-Z])(\d+)(?:\.pkl|\.pickle|\.json)?$")
_P2P_NAME = re.compile(r"(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
_SKIP_SUFFIXES = (".log", ".txt", ".md", ".jsonl", ".py", ".csv")
_DONE_STATES = ("completed",)
MAX_WORLD = DEFAULT_MAX_WORLD
"""Ranks (and group members) must be below this; larger ones are refused with a note."""
MAX_RANKS_TEXT = 8 * MAX_WORLD
"""Characters of a member list written as text (``"[0, 1, 2]"``); longer ones are refused."""
_RANKS_TEXT = re.compile(r"\s*[\[(]\s*(?:\d{1,10}\s*,\s*)*(?:\d{1,10}\s*(?:,\s*)?)?[\])]\s*")


@dataclass(slots=True)
class Op:
    """One collective or point-to-point op of one rank, as the dump saw it."""

    group: str  # global group name (pg_config key)
    seq: int | None  # collective_seq_id for collectives; None for p2p
    op: str
    state: str
    order: int  # record id (or position): the rank's own issue order
    t_ns: int | None
    p2p: bool = False
    p2p_seq: int | None = None
    peer: int | None = None  # global rank of the p2p peer
    group_coll_seq: int | None = None  # the group's collective counter when a p2p op was issued

    @property
    def done(self) -> bool:
        return self.state in _DONE_STATES


@dataclass(slots=True)
class RankDump:
    """What one rank's dump says: its groups, its ops, its per-group counters."""

    rank: int
    version: str
    file: str
    groups: dict[str, tuple[str, tuple[int, ...]]]  # name -> (desc, member ranks)
    status: dict[str, tuple[int, int]]  # local pg_id -> (last enqueued, last completed)
    pg_names: dict[str, str]  # local pg_id -> global group name, where known
    ops: list[Op]
    notes: list[str] = field(default_factory=list)
    timeout_ms: int | None = None  # the watchdog timeout the entries carry

    @property
    def pending(self) -> list[Op]:
        return sorted((o for o in self.ops if not o.done), key=lambda o: o.order)


@dataclass(slots=True)
class DumpReport:
    """Everything the import noticed, worded for the person reading it."""

    directory: str = ""
    loaded: list[int] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # unsafe pickles: file -> reason
    corrupt: dict[str, str] = field(default_factory=dict)  # truncated / not a dump
    skipped: list[str] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)
    versions: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    world: int = 0

    def lines(self) -> list[str]:
        out = [f"flight recorder dumps in {self.directory}: {len(self.loaded)} ranks loaded"]
        if self.versions:
            vs = ", ".join(f"{v} (ranks {_span(rs)})" for v, rs in sorted(self.versions.items()))
            out.append(f"  format versions: {vs}")
        out += [f"  REFUSED {f}: {why}" for f, why in sorted(self.refused.items())]
        out += [f"  unreadable {f}: {why}" for f, why in sorted(self.corrupt.items())]
        if self.missing:
            out.append(
                f"  no usable dump for ranks {_span(self.missing)} of world {self.world}: "
                "a rank that did not dump may have crashed; it is treated as silent"
            )
        if self.empty:
            out.append(f"  ranks {_span(self.empty)}: empty entry list (no collective in flight)")
        out += [f"  note: {n}" for n in self.notes]
        return out


def _span(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def dump_rank_of(path: Path) -> int | None:
    """The rank a dump file is for, from the trailing number of its name."""
    if path.name.endswith(_SKIP_SUFFIXES):
        return None
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _members(raw, notes: list[str] | None = None) -> tuple[int, ...]:
    """A group's member ranks: a list, or the text of one (``"[0, 1, 2]"`` in 2.x dumps),
    read by a bounded parser; members at or past ``MAX_WORLD`` are dropped with a note."""
    if isinstance(raw, str):
        if len(raw) > MAX_RANKS_TEXT or not _RANKS_TEXT.fullmatch(raw):
            if notes is not None:
                notes.append(f"a member list of {len(raw)} characters is not a list of ranks")
            return ()
        raw = [int(x) for x in re.findall(r"\d+", raw)]
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_WORLD:
        return ()
    out = tuple(x for x in raw if isinstance(x, int) and not isinstance(x, bool) and x >= 0)
    if any(x >= MAX_WORLD for x in out):
        if notes is not None:
            notes.append(f"group members at or past {MAX_WORLD} dropped")
        out = tuple(x for x in out if x < MAX_WORLD)
    return out


def _int(x) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _group_of(entry: dict) -> tuple[str | None, str]:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    if isinstance(pg, str):
        return pg, ""
    return None, ""


def _peer(name: str, members: tuple[int, ...], rank: int) -> int | None:
    """Global rank of a p2p op's peer from ``nccl:send 0->1`` / ``nccl:recv 1<-0``.

    The numbers are group-local ranks in 2.x dumps; a name written with
    global ranks (the default group, or older writers) is recognised because
    its own side is then this rank itself.
    """
    m = _P2P_NAME.search(name)
    if not m:
        return None
    me, other = int(m.group(2)), int(m.group(4))
    if members and me < len(members) and members[me] == rank and other < len(members):
        return members[other]
    if me == rank:
        return other
    return None


def parse_dump(obj, rank: int, file: str) -> RankDump:
    """Turn one unpickled dump into a ``RankDump``; raises ValueError if it is not one."""
    if not isinstance(obj, dict) or not ({"entries", "pg_config"} & set(obj)):
        raise ValueError("not a flight recorder dump (no 'entries' or 'pg_config')")
    version = str(obj.get("version", "unknown"))
    notes: list[str] = []
    groups: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, cfg in (obj.get("pg_config") or {}).items():
        if isinstance(cfg, dict):
            name = str(cfg.get("name", key))
            groups[name] = (str(cfg.get("desc", "")), _members(cfg.get("ranks"), notes))
    status: dict[str, tuple[int, int]] = {}
    for pg_id, st in (obj.get("pg_status") or {}).items():
        if isinstance(st, dict):
            enq, comp = (
                _int(st.get("last_enqueued_collective")),
                _int(st.get("last_completed_collective")),
            )
            if enq is not None and comp is not None:
                status[str(pg_id)] = (enq, comp)
    entries = obj.get("entries") or []
    if not isinstance(entries, list):
        raise ValueError("'entries' is not a list")
    ops: list[Op] = []
    pg_names: dict[str, str] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            notes.append(f"entry {i} is not a dict; skipped")
            continue
        gname, desc = _group_of(e)
        if gname is None:
            notes.append(f"entry {i} has no process group; skipped")
            continue
        if gname not in groups:
            groups[gname] = (desc, ())
        if _int(e.get("pg_id")) is not None:
            pg_names[str(e["pg_id"])] = gname
        name = str(e.get("profiling_name") or e.get("frame_name") or "")
        p2p = e.get("is_p2p")
        if p2p is None:
            p2p = bool(_P2P_NAME.search(name))
        seq = _int(e.get("collective_seq_id", e.get("seq_id")))
        t_ns = _int(e.get("time_created_ns"))
        state = e.get("state")
        ops.append(
            Op(
                group=gname,
                seq=None if p2p else seq,
                op=name.removeprefix("nccl:"),
                state=str(state or "scheduled"),
                order=_int(e.get("record_id")) if _int(e.get("record_id")) is not None else i,
                t_ns=t_ns,
                p2p=bool(p2p),
                p2p_seq=_int(e.get("p2p_seq_id")) if p2p else None,
                peer=_peer(name, groups[gname][1], rank) if p2p else None,
                group_coll_seq=seq if p2p else None,
            )
        )
    configured = [str(c.get("name", k)) for k, c in (obj.get("pg_config") or {}).items()
                  if isinstance(c, dict)]  # fmt: skip
    _infer_pg_names(configured, status, pg_names, notes)
    timeouts = [t for e in entries if isinstance(e, dict) and (t := _int(e.get("timeout_ms")))]
    return RankDump(
        rank, version, file, groups, status, pg_names, ops, notes, max(timeouts, default=None)
    )


def _infer_pg_names(names: list[str], status, pg_names, notes) -> None:
    """Map local pg ids to global group names for groups without entries.

    Both are creation counters: a rank numbers the groups it belongs to in
    the order it creates them, and the default names are the global creation
    count. So when every name is a number and the counts agree, sorting both
    pairs them; the pairs the entries already fix must agree, or nothing is
    inferred.
    """
    numeric = all(n.isdigit() for n in names) and all(k.isdigit() for k in status)
    if len(names) != len(status) or not numeric:
        if len(pg_names) < len(status):
            notes.append("some groups' counters could not be matched to group names")
        return
    guess = dict(zip(sorted(status, key=int), sorted(names, key=int), strict=True))
    if any(guess.get(k) != v for k, v in pg_names.items()):
        notes.append("group ids and names disagree with the entries; counters left unmatched")
        return
    pg_names.update(guess)


def _load(path: Path):
    """A dump's dict: JSON when the file is JSON (the JSON trace format), else a
    pickle loaded with no globals allowed."""
    with open(path, "rb") as fh:  # read(size), not read(MAX): that allocates the maximum
        data = fh.read(min(path.stat().st_size, MAX_PICKLE_BYTES) + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise ValueError(f"larger than {MAX_PICKLE_BYTES} bytes; not a flight recorder dump")
    if data.lstrip()[:1] == b"{":
        import orjson

        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"bad JSON dump: {exc}") from None
    return safe_loads(data)


def load_dumps(directory, world: int | None = None) -> tuple[dict[int, RankDump], DumpReport]:
    """Load every rank's dump in ``directory``; problems go to the report, never raise."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such directory")
    report = DumpReport(directory=str(d))
    dumps: dict[int, RankDump] = {}
    for f in sorted(p for p in d.iterdir() if p.is_file()):
        rank = dump_rank_of(f)
        if rank is None:
            report.skipped.append(f.name)
            continue
        if rank >= MAX_WORLD:
            report.corrupt[f.name] = f"rank {rank} from the file name is not below {MAX_WORLD}"
            continue
        try:
            dump = parse_dump(_load(f), rank, f.name)
        except UnsafePickleError as exc:
            report.refused[f.name] = f"pickle tries to run code, refused ({exc})"
            continue
        except (PickleFormatError, ValueError, OSError) as exc:
            report.corrupt[f.name] = str(exc)
            continue
        if rank in dumps:
            report.notes.append(f"two dumps for rank {rank}; kept {dumps[rank].file}")
            continue
        dumps[rank] = dump
        report.loaded.append(rank)
        report.versions.setdefault(dump.version, []).append(rank)
        if not dump.ops:
            report.empty.append(rank)
        report.notes += [f"rank {rank}: {n}" for n in dump.notes]
    declared: set[int] = set()
    for dump in dumps.values():
        for _, members in dump.groups.values():
            declared.update(members)
    if declared:  # a file name alone never makes a rank (or a world)
        for rank in [r for r in dumps if r not in declared]:
            f = dumps.pop(rank).file
            report.corrupt[f] = (f"rank {rank} from the file name is in none of the declared "
                                 "process groups")  # fmt: skip
            report.loaded.remove(rank)
            for ranks in report.versions.values():
                if rank in ranks:
                    ranks.remove(rank)
            if rank in report.empty:
                report.empty.remove(rank)
    known = declared | set(dumps)
    if world is not None and world > MAX_WORLD:
        report.notes.append(f"world {world} given is past the limit {MAX_WORLD}; ignored")
        world = None
    report.world = max(world or 0, max(known) + 1 if known else 0)
    report.missing = sorted(set(range(report.world)) - set(dumps))
    report.loaded.sort()
    report.empty.sort()
    for ranks in report.versions.values():
        ranks.sort()
    return dumps, report

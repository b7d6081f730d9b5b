"""The one validation entry every input lane uses: bytes or decoded objects in, bounded records out.

JSONL and Parquet files (``rankscope.pipeline.traces.files``), Kafka messages
(``rankscope.pipeline.bus.decode``) and the embedded bus of the demo all call
``check_record`` (or, on their fast paths, ``bounds_reason`` /
``columns_bounds_reason``, which give the same verdict) on top of the
contract's own ``validate_record``. The contract checks names and types; this
module checks that the values are ones the service can hold: a schema-valid
record with ``step = 2**64 - 1`` or ``world = 2**20`` used to stop ``serve`` or
eat gigabytes. Every rejection says which bound it broke. The limits and why
they are what they are: docs/trace-format.md ("Bounds").

Checks that need a job's state (a step too far ahead of the job's current
step, a world other than the job's, a ``t`` far ahead of the job's clock) live
where that state is, the step assembler.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from operator import lt
from typing import Any

import numpy as np
import orjson
from rankscope.collectors.schema.records import (
    COLLECTIVE_FIELDS,
    LIST_ITEMS,
    SCHEMA,
    RecordError,
    validate_record,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_WORLD",
    "INT64_MAX",
    "INT64_MIN",
    "Limits",
    "bounds_reason",
    "check_record",
    "columns_bounds_reason",
    "parse_json",
    "array_rejects",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
DEFAULT_MAX_WORLD = 65_536
"""The largest world (and so rank + 1) a record may claim; the one default of it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """What a record's values may be (every lane, before any state is touched)."""

    max_world: int = DEFAULT_MAX_WORLD
    """``world`` in 1..max_world; ``rank`` and parallel coordinates in 0..max_world-1."""
    max_str_len: int = 1024
    """Characters of any string field (job, host, digest, names of groups and ops)."""
    max_list_len: int = 65_536
    """Elements of any list field (collectives of a step, ranks of a group, XIDs)."""
    max_abs_t_s: float = 1e11
    """A finite ``t`` beyond this many seconds from the epoch (year 5138) is no time at all."""

    def __post_init__(self) -> None:
        for name in ("max_world", "max_str_len", "max_list_len"):
            value = getattr(self, name)
            if not 1 <= value <= INT64_MAX:
                raise ValueError(f"{name} must be in 1..2**63-1, got {value}")
        if not self.max_abs_t_s > 0:
            raise ValueError(f"max_abs_t_s must be > 0, got {self.max_abs_t_s}")


DEFAULT_LIMITS = Limits()

_RANKED = ("rank", "dp", "tp", "pp", "cp", "ep")  # 0..max_world-1
_COLL_INTS = tuple(n for n, (ty, _r) in COLLECTIVE_FIELDS.items() if ty == (int,))
_COLL_STRS = tuple(n for n, (ty, _r) in COLLECTIVE_FIELDS.items() if ty == (str,))


def parse_json(raw: bytes | str) -> Any:
    """Decode one JSON text; raises ValueError with the reason.

    orjson is the common path. It refuses the bare ``NaN``, ``Infinity`` and
    ``-Infinity`` tokens the trace format allows, so a text that orjson refuses
    and that holds one of them is parsed again by the standard library (only
    those texts pay for it); too deep a nesting there is an error, not a crash.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        first = exc
    probe = raw if isinstance(raw, bytes) else raw.encode("utf-8", "replace")
    if b"NaN" in probe or b"Infinity" in probe:
        try:
            return json.loads(raw)
        except RecursionError:
            raise ValueError("bad JSON: nested too deeply") from None
        except ValueError:
            pass
    raise ValueError(f"bad JSON: {first}") from None


def check_record(obj: Any, limits: Limits = DEFAULT_LIMITS) -> dict:
    """``validate_record`` plus the bounds of ``limits``: the record normalised, or RecordError."""
    rec = validate_record(obj)
    reason = bounds_reason(rec, limits)
    if reason is not None:
        raise RecordError(reason)
    return rec


def _int_reason(name: str, value: int) -> str | None:
    if INT64_MIN <= value <= INT64_MAX:
        return None
    return f"field '{name}' = {_short(value)} is outside the 64-bit integer range"


def _short(value: Any) -> str:
    text = str(value) if not isinstance(value, int) or value.bit_length() < 400 else "a huge int"
    return text if len(text) <= 40 else text[:37] + "..."


def _list_reason(name: str, value: list, item: type | None, limits: Limits) -> str | None:
    if len(value) > limits.max_list_len:
        return f"field '{name}' has {len(value)} elements (limit {limits.max_list_len})"
    if item is int:
        for v in value:
            if type(v) is not int:
                return f"field '{name}' should hold ints, got {type(v).__name__}"
            if not 0 <= v < limits.max_world and name == "coll_ranks":
                return f"field '{name}' holds rank {_short(v)} outside 0..{limits.max_world - 1}"
            bad = _int_reason(name, v)
            if bad:
                return bad
    elif item is str:
        for v in value:
            if type(v) is not str:
                return f"field '{name}' should hold strings, got {type(v).__name__}"
            if len(v) > limits.max_str_len:
                return f"field '{name}' holds a string of {len(v)} characters"
    elif item is dict:  # collectives: validate_record checked their shape
        for i, c in enumerate(value):
            for f in _COLL_INTS:
                v = c.get(f)
                if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
                    return f"collectives[{i}]: {_int_reason(f, v)}"
            for f in _COLL_STRS:
                v = c.get(f)
                if type(v) is str and len(v) > limits.max_str_len:
                    return f"collectives[{i}]: field '{f}' is {len(v)} characters long"
    return None


def bounds_reason(rec: dict, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why a schema-valid record is out of bounds, or None when it is within them."""
    kind = rec["type"]
    table = SCHEMA[kind]
    items = LIST_ITEMS[kind]
    for name, value in rec.items():
        if name not in table and name not in ("job", "type"):
            continue  # unknown fields are kept, never read by the service
        t = type(value)
        if t is int:
            bad = _int_reason(name, value)
        elif t is str:
            bad = None
            if len(value) > limits.max_str_len:
                bad = f"field '{name}' is {len(value)} characters long (limit {limits.max_str_len})"
        elif t is list:
            bad = _list_reason(name, value, items.get(name), limits)
        else:
            continue
        if bad:
            return bad
    world = rec.get("world")
    if world is not None and not 1 <= world <= limits.max_world:
        return f"world {_short(world)} outside 1..{limits.max_world}"
    top = world if world is not None else limits.max_world
    for name in _RANKED:
        v = rec.get(name)
        hi = top if name == "rank" else limits.max_world
        if v is not None and not 0 <= v < hi:
            return f"{name} {_short(v)} outside 0..{hi - 1}"
    step = rec.get("step")
    if step is not None and step < 0:
        return f"step {step} is negative"
    t = rec.get("t")
    if t is not None and not abs(t) <= limits.max_abs_t_s and not math.isnan(t):
        return f"t {_short(t)} is not a time (|t| must be <= {limits.max_abs_t_s:g} s)"
    return None


def _categories(kind: str) -> dict[str, str]:
    """name -> what to check for each known field of ``kind`` (and job, type)."""
    out = {"job": "str", "type": "str"}
    for name, (types, _req) in SCHEMA[kind].items():
        out[name] = {(int,): "int", (str,): "str", (list,): "list"}.get(types, "num")
    return out


_CATEGORIES = {kind: _categories(kind) for kind in SCHEMA}


def columns_bounds_reason(kind: str, cols: dict[str, list], limits: Limits = DEFAULT_LIMITS,
                          types: dict[str, set] | None = None) -> str | None:  # fmt: skip
    """``bounds_reason`` over records given as value lists, one per field (all records of one
    shape whose types the schema names exactly): None when every record is within bounds.

    Whole-list C-level passes (min, max, map) instead of a record at a time; ``types``
    (field -> the set of value types, when the caller has it) spares a pass over number
    fields that hold no int. On any doubt it answers with a reason and the caller judges
    record by record.
    """
    cats = _CATEGORIES[kind]
    items = LIST_ITEMS[kind]
    lohi: dict[str, tuple[int, int]] = {}
    for name, vals in cols.items():
        cat = cats.get(name)
        if cat is None:
            continue  # unknown fields are kept, never read by the service
        if cat == "int":
            lo, hi = min(vals), max(vals)
            if lo < INT64_MIN or hi > INT64_MAX:
                return f"a '{name}' integer is outside the 64-bit range"
            lohi[name] = (lo, hi)
        elif cat == "str":
            if max(map(len, vals)) > limits.max_str_len:
                return f"a '{name}' string is too long"
        elif cat == "num":
            if types is not None and int not in types.get(name, (int,)):
                continue
            ints = [v for v in vals if type(v) is int]
            if ints and (min(ints) < INT64_MIN or max(ints) > INT64_MAX):
                return f"a '{name}' integer is outside the 64-bit range"
        elif any(_list_reason(name, v, items.get(name), limits) for v in vals if v):
            return f"a '{name}' list is out of bounds"
    world = lohi.get("world")
    if world is not None and (world[0] < 1 or world[1] > limits.max_world):
        return f"world outside 1..{limits.max_world}"
    for name in _RANKED:
        r = lohi.get(name)
        if r is not None and (r[0] < 0 or r[1] >= limits.max_world):
            return f"{name} outside 0..{limits.max_world - 1}"
    if world is not None and "rank" in cols and not all(map(lt, cols["rank"], cols["world"])):
        return "rank outside 0..world-1"
    step = lohi.get("step")
    if step is not None and step[0] < 0:
        return "a negative step"
    t = cols.get("t")
    if t is not None:
        bound = limits.max_abs_t_s
        if len(t) <= 64:
            bad = any(x > bound or x < -bound for x in t)  # NaN compares False: accepted
        else:
            bad = bool((np.abs(np.asarray(t, dtype=np.float64)) > bound).any())
        if bad:
            return "a t that is not a time"
    return None


def array_rejects(cols: dict[str, np.ndarray], limits: Limits = DEFAULT_LIMITS):
    """The bounds of ``bounds_reason`` over step columns already cast to int64/float64 (the
    Parquet lane): ``(mask, reason)`` pairs, a mask of the rows out of each bound.

    ``cols`` holds ``rank``, ``world``, ``step``, ``t``, the coordinates present and, for
    string fields, their lengths under ``len:<name>``.
    """
    out = []
    world, rank = cols["world"], cols["rank"]
    out.append(((world < 1) | (world > limits.max_world), f"world outside 1..{limits.max_world}"))
    out.append(((rank < 0) | (rank >= world), "rank outside 0..world-1"))
    out.append((cols["step"] < 0, "step is negative"))
    with np.errstate(invalid="ignore"):
        out.append((np.abs(cols["t"]) > limits.max_abs_t_s, "t is not a time"))
    for name in _RANKED[1:]:
        v = cols.get(name)
        if v is not None:  # absent coordinates are -1 there
            bad = (v < -1) | (v >= limits.max_world)
            out.append((bad, f"{name} outside 0..{limits.max_world - 1}"))
    for key, lens in cols.items():
        if key.startswith("len:"):
            out.append((lens > limits.max_str_len, f"field '{key[4:]}' is too long"))
    return out

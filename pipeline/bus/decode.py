"""Message values in, validated records out, with a fast path for the common case.

``rankscope.collectors.schema.records.validate_record`` costs about 12 µs a record; at the
service's target of 100,000 records a second that alone would take more than
one of the machine's two cores. ``check_fast`` accepts exactly the records
that ``validate_record`` accepts *unchanged* (every known field of the exact
type the schema names, required fields present, a known version, type and
beat phase, well-formed collectives), judging each record *shape* (field
names and value types) once and then with one dictionary lookup a record,
since one producer's records all share a shape. Anything else (a whole float
in an int field that needs normalising, a malformed record) goes to
``validate_record``, which normalises it or says why it is unusable. The
verdict is therefore always ``validate_record``'s, plus the bounds of
``rankscope.pipeline.traces.validate`` (the one validation entry: the fast
paths ask ``bounds_reason`` / ``columns_bounds_reason``, the slow path
``check_record``). An array keeps its good records when an element is bad,
even one that is no record at all.

The usual message, one producer's array of ``step`` records, first tries a
typed decode (``typed_step_columns``): msgspec parses the array into structs
declared from the schema table, checking each value's exact type as it parses
(an int field refuses ``3.0`` and ``true``; an unknown field, a ``null``, a
``NaN`` token or another record type refuses the whole message), at about a
third of the cost of orjson dicts plus ``uniform_columns``. Whatever it
refuses takes the way above, so the verdict does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

import msgspec
import numpy as np
from msgspec.structs import astuple
from rankscope.collectors.schema.records import COLLECTIVE_FIELDS, PHASES, SCHEMA, RecordError
from rankscope.pipeline.bus.kafka import decode_value
from rankscope.pipeline.engine.columns import chunk_from_columns
from rankscope.pipeline.traces.validate import (
    bounds_reason,
    check_record,
    columns_bounds_reason,
)

__all__ = ["COLUMNS_MIN_RECORDS", "StepBatch", "check_fast", "decode_message", "decode_records",
           "uniform_columns", "typed_step_columns"]  # fmt: skip

COLUMNS_MIN_RECORDS = 32
"""Messages of fewer step records go the record path (arrays cost a fixed ~30 µs)."""


@dataclass(slots=True)
class StepBatch:
    """Valid ``step`` records of one job as columns (``rankscope.pipeline.engine.columns`` chunk
    format, plus ``step``), in message order."""

    job: str
    step: np.ndarray
    chunk: dict[str, np.ndarray]
    n: int

    @classmethod
    def of(cls, cols: dict[str, list], n: int) -> StepBatch | None:
        """From ``uniform_columns`` lists; None when a number does not fit int64/float64
        (the record path then refuses or normalises it as it always did)."""
        try:
            step = np.array(cols["step"], dtype=np.int64)
            chunk = chunk_from_columns(cols, n)
        except (OverflowError, ValueError, TypeError):
            return None
        return cls(cols["job"][0], step, chunk, n)


def _exact(types: tuple[type, ...]) -> frozenset[type]:
    # bool is never a number here, and an exact-type check already excludes it.
    return frozenset(types)


_COMMON = {"v": frozenset({int}), "type": frozenset({str}), "job": frozenset({str})}
_TABLES = {
    kind: {**_COMMON, **{name: _exact(types) for name, (types, _req) in table.items()}}
    for kind, table in SCHEMA.items()
}
_REQUIRED = {
    kind: frozenset(["v", "type", "job", *(n for n, (_t, req) in table.items() if req)])
    for kind, table in SCHEMA.items()
}
_COLL_TYPES = {name: _exact(types) for name, (types, _req) in COLLECTIVE_FIELDS.items()}
_COLL_REQUIRED = frozenset(n for n, (_t, req) in COLLECTIVE_FIELDS.items() if req)
_PHASES = frozenset(PHASES)


def _shape_ok(rec: dict) -> bool:
    kind = rec.get("type")
    table = _TABLES.get(kind) if type(kind) is str else None
    if table is None or not _REQUIRED[kind] <= rec.keys():
        return False
    for name, value in rec.items():
        allowed = table.get(name)
        if allowed is not None and type(value) not in allowed:
            return False
    return True


def _coll_shape_ok(c: dict) -> bool:
    if not _COLL_REQUIRED <= c.keys():
        return False
    for name, value in c.items():
        allowed = _COLL_TYPES.get(name)
        if allowed is not None and type(value) not in allowed:
            return False
    return True


# Verdicts per record shape (type, field names and value types in order): one
# producer's records all share a shape, so a record costs one lookup.
_SHAPES: dict[tuple, bool] = {}
_COLL_SHAPES: dict[tuple, bool] = {}
_MAX_SHAPES = 4096


def _judge(rec: dict, key: tuple) -> bool:
    if len(_SHAPES) >= _MAX_SHAPES:
        _SHAPES.clear()
    ok = _SHAPES[key] = _shape_ok(rec)
    return ok


def _colls_ok(colls) -> bool:
    for c in colls:
        if type(c) is not dict:
            return False
        key = (tuple(c), tuple(map(type, c.values())))
        ok = _COLL_SHAPES.get(key)
        if ok is None:
            if len(_COLL_SHAPES) >= _MAX_SHAPES:
                _COLL_SHAPES.clear()
            ok = _COLL_SHAPES[key] = _coll_shape_ok(c)
        if not ok:
            return False
    return True


def check_fast(rec) -> bool:
    """True when ``rec`` is certainly valid as it stands (no normalisation needed)."""
    if type(rec) is not dict:
        return False
    kind = rec.get("type")
    if type(kind) is not str:
        return False
    key = (kind, tuple(rec), tuple(map(type, rec.values())))
    ok = _SHAPES.get(key)
    if ok is None:
        ok = _judge(rec, key)
    if not ok or rec["v"] != 1:
        return False
    if kind == "beat" and rec["phase"] not in _PHASES:
        return False
    colls = rec.get("collectives")
    if colls and not _colls_ok(colls):
        return False
    return bounds_reason(rec) is None


def uniform_columns(recs: list[dict]) -> dict[str, list] | None:
    """The fields of ``recs`` as value lists when every record passes ``check_fast``,
    judged a field at a time; else None.

    The common message: one producer's array of records of one shape. Each test
    is a C-level ``map``/``set`` pass over the whole array (no Python bytecode a
    record): equal key counts plus every key of the first record present in all
    means one key set; then each field's value types must be ones the schema
    names exactly. Any variation returns None and the caller judges record by
    record, so the verdict is still ``check_fast``'s (and so ``validate_record``'s).
    The lists are kept because the columnar path (``decode_message``) builds its
    arrays from them.
    """
    if set(map(type, recs)) != {dict}:
        return None
    first = recs[0]
    kind = first.get("type")
    table = _TABLES.get(kind) if type(kind) is str else None
    if table is None or not _REQUIRED[kind] <= first.keys():
        return None
    if len(set(map(len, recs))) != 1:
        return None
    cols: dict[str, list] = {}
    types: dict[str, set] = {}
    try:
        for name in first:
            vals = cols[name] = list(map(itemgetter(name), recs))
            allowed = table.get(name)
            if allowed is not None and not (types.setdefault(name, set(map(type, vals)))
                                            <= allowed):  # fmt: skip
                return None
    except KeyError:  # a record lacks a field of the first: another shape
        return None
    if set(cols["type"]) != {kind} or set(cols["v"]) != {1}:
        return None
    if kind == "beat" and not set(cols["phase"]) <= _PHASES:
        return None
    if "collectives" in cols and not all(not c or _colls_ok(c) for c in cols["collectives"]):
        return None
    if columns_bounds_reason(kind, cols, types=types) is not None:
        return None
    return cols


def _typed_step():
    """The step record as a msgspec struct, field by field from the schema table; the
    type hint of each field, and the names of its optional and its int-or-float fields."""
    exact = {frozenset({t}): t for t in (int, str, bool, list, dict)}
    hints: dict[str, Any] = {"v": int, "type": Literal["step"], "job": str}
    fields: list[tuple] = list(hints.items())
    optional, numbers = [], []
    for name, (types, required) in SCHEMA["step"].items():
        if frozenset(types) == {int, float}:
            hint: Any = int | float  # an int stays an int: the bounds check needs to know
            numbers.append(name)
        else:
            hint = exact[frozenset(types)]
        hints[name] = hint
        if required:
            fields.append((name, hint))
        else:
            fields.append((name, hint | msgspec.UnsetType, msgspec.UNSET))
            optional.append(name)
    # gc=False: the structs hold no cycles, and millions of them would wake the collector
    cls = msgspec.defstruct("TypedStep", fields, kw_only=True, forbid_unknown_fields=True,
                            gc=False)  # fmt: skip
    return cls, hints, frozenset(optional), frozenset(numbers)


_TYPED_STEP, _HINTS, _OPTIONAL, _NUMBERS = _typed_step()
_TYPED_DECODER = msgspec.json.Decoder(list[_TYPED_STEP])
_TYPED_FIELDS = tuple(
    (name, name in _OPTIONAL, name in _NUMBERS) for name in _TYPED_STEP.__struct_fields__
)
_KNOWN_TYPES = {"v": {int}, "type": {str}, "job": {str}} | {
    name: set(types) for name, (types, _req) in SCHEMA["step"].items() if name not in _NUMBERS
}


class _Shape:
    """A decoder for step arrays of exactly one shape (these fields, all present, v 1).

    One producer sends one shape message after message, so the last shape that
    decoded is tried first: a struct of only its fields, all required and unknown
    ones forbidden, accepts a message only when every record has exactly those
    fields, so there is no absent-field pass and no transposition of the ~40
    unset optional fields; a message it refuses takes the general decode."""

    __slots__ = ("names", "numbers", "decoder")

    def __init__(self, names: tuple[str, ...]) -> None:
        hints = {**_HINTS, "v": Literal[1]}  # the version checked while parsing
        cls = msgspec.defstruct("StepShape", [(n, hints[n]) for n in names], kw_only=True,
                                forbid_unknown_fields=True, gc=False)  # fmt: skip
        self.names = names
        self.numbers = tuple(n for n in names if n in _NUMBERS)
        self.decoder = msgspec.json.Decoder(list[cls])

    def columns(self, value: bytes, min_records: int):
        """(columns, types) of ``value``; None when this shape's struct refuses it."""
        try:
            recs = self.decoder.decode(value)
        except msgspec.DecodeError:
            return None
        if len(recs) < max(1, min_records):
            return None
        cols = dict(zip(self.names, zip(*map(astuple, recs), strict=True), strict=True))
        types = {n: set(map(type, cols[n])) for n in self.numbers}
        return cols, types


_SHAPE: list[_Shape | None] = [None]  # the last shape that decoded (see ``_Shape``)


def typed_step_columns(value: bytes, min_records: int = COLUMNS_MIN_RECORDS,
                       ) -> dict[str, list] | None:  # fmt: skip
    """``uniform_columns`` of an array of at least ``min_records`` step records, decoded
    typed (see the module docstring); None for anything else, decoded the old way."""
    if value[:1] != b"[":
        return None
    shape = _SHAPE[0]
    got = shape.columns(value, min_records) if shape is not None else None
    if got is None:
        got = _general_columns(value, min_records)
        if got is None:
            return None
        if shape is None or shape.names != tuple(got[0]):
            _SHAPE[0] = _Shape(tuple(got[0]))
    cols, types = got
    types = _KNOWN_TYPES | types
    colls = cols.get("collectives")
    if colls is not None and not all(not c or _colls_ok(c) for c in colls):
        return None
    if columns_bounds_reason("step", cols, types=types) is not None:
        return None
    return cols


def _general_columns(value: bytes, min_records: int):
    """(columns, types of the optional and number fields) from the struct of every step
    field; None when it refuses the value or its records are not of one shape."""
    try:
        recs = _TYPED_DECODER.decode(value)
    except msgspec.DecodeError:  # ValidationError too: a type, a field, a token
        return None
    n = len(recs)
    if n < min_records:
        return None
    cols: dict[str, list] = {}
    types: dict[str, set] = {}
    unset, unset_type = msgspec.UNSET, msgspec.UnsetType
    # one C-level transposition (struct -> tuple, then zip) instead of a pass a field
    columns = zip(*map(astuple, recs), strict=True)
    for (name, optional, number), vals in zip(_TYPED_FIELDS, columns, strict=True):
        if optional and vals[0] is unset:
            if vals.count(unset) != n:  # identity first: cheap while all are unset
                return None  # a field some records have and others lack: not one shape
            continue
        if optional or number:
            seen = set(map(type, vals))
            if unset_type in seen:
                return None
            types[name] = seen
        cols[name] = vals
    if set(cols["v"]) != {1}:
        return None
    return cols, types


def decode_records(value: bytes | None, good: list[dict], bad: list[tuple[int, str, dict]]):
    """Decode one message value into ``good`` records; ``bad`` gets ``(index, reason,
    record)`` per unusable record. Raises ValueError when the value itself is unusable."""
    _decode_into(decode_value(value), good, bad)


def decode_message(value: bytes | None, good: list[dict], bad: list[tuple[int, str, dict]],
                   *, min_columns: int = COLUMNS_MIN_RECORDS) -> StepBatch | None:  # fmt: skip
    """``decode_records``, except that a message of at least ``min_columns`` valid
    ``step`` records of one job and one shape comes back as a ``StepBatch`` (columns,
    nothing added to ``good``): the per-record Python work of the assembler is then
    skipped. Smaller messages cost less as records than as arrays."""
    cols = typed_step_columns(value, min_columns) if value is not None else None
    if cols is not None:
        if len(set(cols["job"])) == 1:
            batch = StepBatch.of(cols, len(cols["job"]))
            if batch is not None:
                return batch
    recs = decode_value(value)
    if len(recs) >= min_columns and type(recs[0]) is dict and recs[0].get("type") == "step":
        cols = uniform_columns(recs)
        if cols is not None and len(set(cols["job"])) == 1:
            batch = StepBatch.of(cols, len(recs))
            if batch is not None:
                return batch
        if cols is not None:  # valid, just not one job (or not representable as arrays)
            good.extend(recs)
            return None
    _decode_into(recs, good, bad)
    return None


def _decode_into(recs: list, good: list[dict], bad: list[tuple[int, str, dict]]) -> None:
    if recs and type(recs[0]) is dict and uniform_columns(recs) is not None:
        good.extend(recs)
        return
    prev = None  # (keys, types) of the previous record that passed: arrays repeat one shape
    for i, rec in enumerate(recs):
        if type(rec) is not dict:
            bad.append((i, f"array element {i} is a {type(rec).__name__}, not a record", rec))
            continue
        keys = tuple(rec)
        types = tuple(map(type, rec.values()))
        if (
            prev is not None
            and keys == prev[0]
            and types == prev[1]
            and rec["type"] == prev[2]
            and rec["v"] == 1
            and (prev[2] != "beat" or rec["phase"] in _PHASES)
            and (not rec.get("collectives") or _colls_ok(rec["collectives"]))
            and bounds_reason(rec) is None
        ):
            good.append(rec)
            continue
        if check_fast(rec):
            good.append(rec)
            prev = (keys, types, rec["type"])
            continue
        try:
            good.append(check_record(rec))
        except RecordError as exc:
            bad.append((i, str(exc), rec))

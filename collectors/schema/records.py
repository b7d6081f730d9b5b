"""The record schema of trace format version 1 (docs/trace-format.md).

This module is the contract every other part of rankscope shares: the
collectors build records with it, the readers validate with it, and the
detectors read the field names defined here. It imports nothing heavier than
the standard library so that a training process attaching a collector pays
nothing for it.

Records travel as plain dicts (the JSON object of one line). The slotted
dataclasses below are what collectors fill in; ``to_dict`` drops fields that
are ``None`` so that absent readings stay absent on the wire.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

__all__ = [
    "FORMAT_VERSION",
    "RECORD_TYPES",
    "LABEL_KINDS",
    "ACTIONS",
    "PHASES",
    "StepRecord",
    "BeatRecord",
    "GpuRecord",
    "CheckRecord",
    "Collective",
    "SCHEMA",
    "COLLECTIVE_FIELDS",
    "LIST_ITEMS",
    "validate_record",
    "validate_label",
    "record_key",
    "RecordError",
]

FORMAT_VERSION = 1
LABEL_KINDS = ("straggler", "network", "sdc", "nonfinite", "hang", "crash", "gpu")
ACTIONS = ("evict", "recover", "observe")
PHASES = ("data", "forward", "backward", "collective", "optimizer", "idle")


class RecordError(ValueError):
    """A record that breaks the schema; the message says which field and why."""


# The record shapes are declared once, as the dataclasses at the end of this
# module; the validation tables below are derived from them. ``float`` fields
# accept ints too (JSON does not distinguish 1 from 1.0); bools are never
# numbers here even though Python says bool is an int.
_NUM = (int, float)
_INT = (int,)
_STR = (str,)
_BOOL = (bool,)
_LIST = (list,)

_COMMON = {"v": (_INT, True), "type": (_STR, True), "job": (_STR, True)}


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, float) and int in types and float not in types:
        # 3.0 written by a foreign tool for an int field: accept whole floats.
        return math.isfinite(value) and value.is_integer()
    return isinstance(value, types)


def _check_fields(obj: dict, table: dict, where: str) -> None:
    for name, (types, required) in table.items():
        value = obj.get(name)
        if value is None:
            if required:
                raise RecordError(f"{where}missing required field '{name}'")
            continue
        if not _type_ok(value, types):
            expected = "/".join(t.__name__ for t in types)
            raise RecordError(
                f"{where}field '{name}' should be {expected}, got {type(value).__name__}"
            )


def validate_record(obj: Any) -> dict:
    """Check one decoded record against the schema and return it normalised.

    Normalising means: whole floats in int fields become ints, so that
    ``"step": 3.0`` from a foreign writer keys the same step as ``3``. Unknown
    fields are kept (the format allows adding fields). Raises ``RecordError``
    with the reason when the record cannot be used.
    """
    if not isinstance(obj, dict):
        raise RecordError(f"record should be a JSON object, got {type(obj).__name__}")
    _check_fields(obj, _COMMON, "")
    if obj["v"] != FORMAT_VERSION:
        raise RecordError(f"unknown format version v={obj['v']!r} (this reader knows v=1)")
    table = SCHEMA.get(obj["type"])
    if table is None:
        raise RecordError(f"unknown record type {obj['type']!r}")
    _check_fields(obj, table, "")
    for name, (types, _) in table.items():
        value = obj.get(name)
        if types is _INT and isinstance(value, float):
            obj[name] = int(value)
    if obj["type"] == "beat" and obj["phase"] not in PHASES:
        raise RecordError(f"unknown beat phase {obj['phase']!r}")
    colls = obj.get("collectives")
    if colls:
        for i, c in enumerate(colls):
            if not isinstance(c, dict):
                raise RecordError(f"collectives[{i}] should be an object")
            _check_fields(c, COLLECTIVE_FIELDS, f"collectives[{i}]: ")
    return obj


def validate_label(obj: Any) -> dict:
    """Check one line of ``labels.jsonl``."""
    if not isinstance(obj, dict):
        raise RecordError("label should be a JSON object")
    if obj.get("kind") not in LABEL_KINDS:
        raise RecordError(f"unknown label kind {obj.get('kind')!r}")
    ranks = obj.get("ranks")
    if not isinstance(ranks, list) or not all(_type_ok(r, _INT) for r in ranks):
        raise RecordError("label 'ranks' should be a list of ints")
    if not _type_ok(obj.get("step"), _INT):
        raise RecordError("label 'step' should be an int")
    until = obj.get("until")
    if until is not None and not _type_ok(until, _INT):
        raise RecordError("label 'until' should be an int or null")
    obj.setdefault("hosts", [])
    return obj


def record_key(rec: dict) -> tuple:
    """The identity under which duplicates collapse (the last one wins).

    ``step`` and ``check`` records are one per (job, rank, step[, check]);
    beats and GPU samples are one per source and time.
    """
    kind = rec["type"]
    if kind == "step":
        return ("step", rec["job"], rec["rank"], rec["step"])
    if kind == "check":
        return ("check", rec["job"], rec["rank"], rec["step"], rec["check"])
    if kind == "beat":
        return ("beat", rec["job"], rec["rank"], rec["t"])
    return ("gpu", rec["job"], rec["host"], rec["gpu"], rec["t"])


def _as_dict(obj: Any) -> dict:
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = value
    return out


@dataclass(slots=True, kw_only=True)
class Collective:
    """One collective call as seen by one rank: ``s`` seconds inside it."""

    op: str
    group: str
    seq: int
    bytes: int | None = None
    s: float | None = None
    t0: float | None = None

    def to_dict(self) -> dict:
        return _as_dict(self)


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One rank's view of one optimizer step; times in seconds."""

    job: str
    rank: int
    step: int
    world: int
    host: str
    t: float
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    data_s: float | None = None
    # of step_s, the time the training thread sat runnable waiting for a CPU (CPU timing)
    cpu_wait_s: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    grad_norm_reduced: float | None = None
    nonfinite: int | None = None
    param_digest: str | None = None
    lr: float | None = None
    tokens: int | None = None
    dropped: int | None = None
    collectives: list[dict] | None = None
    # sharded data parallelism (FSDP2/HSDP): the parameter shard this rank holds
    # among its dp peers; only peers of equal shard are replicas
    shard: int | None = None
    # true when the loop skipped this iteration's optimizer step (AMP inf/NaN)
    skipped: bool | None = None
    # field -> "NaN" | "Infinity" | "-Infinity" for readings that were not finite: those
    # fields are written as null (JSON has no NaN), so "NaN" and "not reported" differ
    nonfinite_fields: dict[str, str] | None = None
    v: int = FORMAT_VERSION
    type: str = field(default="step", init=False)
    KIND: ClassVar[str] = "step"

    def to_dict(self) -> dict:
        out = _as_dict(self)
        for name in self.nonfinite_fields or ():
            out[name] = None  # written as null; nonfinite_fields says which value it was
        return out


@dataclass(slots=True, kw_only=True)
class BeatRecord:
    """A progress heartbeat: what a rank is doing right now, sent also while blocked."""

    job: str
    rank: int
    host: str
    t: float
    step: int
    phase: str
    coll_group: str | None = None
    coll_seq: int | None = None
    coll_op: str | None = None
    coll_done: bool | None = None
    coll_ranks: list[int] | None = None  # members of coll_group, when the writer knows them
    coll_peer: int | None = None  # the other rank of a point-to-point op
    dropped: int | None = None
    v: int = FORMAT_VERSION
    type: str = field(default="beat", init=False)
    KIND: ClassVar[str] = "beat"

    def to_dict(self) -> dict:
        return _as_dict(self)


@dataclass(slots=True, kw_only=True)
class GpuRecord:
    """One NVML sample of one GPU; unsupported readings stay ``None``."""

    job: str
    host: str
    gpu: int
    t: float
    rank: int | None = None
    util_pct: float | None = None
    mem_used_mb: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    clock_events: list[str] | None = None
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_replay: int | None = None
    nvlink_errors: int | None = None
    xid: list[int] | None = None
    v: int = FORMAT_VERSION
    type: str = field(default="gpu", init=False)
    KIND: ClassVar[str] = "gpu"

    def to_dict(self) -> dict:
        return _as_dict(self)


@dataclass(slots=True, kw_only=True)
class CheckRecord:
    """A replay signature: peers that recomputed the same inputs must agree."""

    job: str
    rank: int
    host: str
    step: int
    t: float
    check: str
    group: str
    signature: str
    v: int = FORMAT_VERSION
    type: str = field(default="check", init=False)
    KIND: ClassVar[str] = "check"

    def to_dict(self) -> dict:
        return _as_dict(self)


_ANNOTATION_TYPES = {int: _INT, float: _NUM, str: _STR, bool: _BOOL, list: _LIST, dict: (dict,)}


def _table(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """name -> (accepted types, required) for a record dataclass, from its annotations."""
    hints = get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if f.name in _COMMON:
            continue
        hint = hints[f.name]
        base = [a for a in get_args(hint) if a is not type(None)] or [hint]
        origin = get_origin(base[0]) or base[0]
        required = f.default is MISSING and f.default_factory is MISSING
        out[f.name] = (_ANNOTATION_TYPES[origin], required)
    return out


def _list_items(cls: type) -> dict[str, type]:
    """name -> element type of each ``list[...]`` field (``collectives``: dict)."""
    hints = get_type_hints(cls)
    out = {}
    for f in fields(cls):
        for arg in get_args(hints[f.name]):
            if get_origin(arg) is list:
                (item,) = get_args(arg)
                out[f.name] = get_origin(item) or item
    return out


# kind -> field table: what every input lane validates against.
SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    cls.KIND: _table(cls) for cls in (StepRecord, BeatRecord, GpuRecord, CheckRecord)
}
COLLECTIVE_FIELDS = _table(Collective)
# kind -> list field -> element type (bounds checks need what a list holds)
LIST_ITEMS: dict[str, dict[str, type]] = {
    cls.KIND: _list_items(cls) for cls in (StepRecord, BeatRecord, GpuRecord, CheckRecord)
}
RECORD_TYPES = tuple(SCHEMA)

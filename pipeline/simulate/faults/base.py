"""What a fault is, what it may touch inside a rank, and the registry of kinds.

A fault class is built once per rank process from its ``FaultSpec`` and gets
a few chances to act inside the real training loop, on every rank (so that a
fault that needs every rank's cooperation, such as running a sampler beside
each rank, can have it; most act only where ``spec.active(rank, step)``):

- ``install(ctx)``: before the collector is attached. Register module,
  parameter-tensor or optimizer hooks here; optimizer post-hooks registered
  now run before the collector's, so that step's digest sees their effect.
- ``before_all_reduce(ctx, bucket)`` / ``after_all_reduce(ctx, bucket, tensor)``:
  inside the DDP communication hook the harness passes to the collector.
- ``close(ctx)``: the run is over (normal end only).

A kind registers itself with ``@register_fault``; every module in this package
is imported on first use, so a new kind is a new file here and nothing else.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Fault",
    "FaultContext",
    "register_fault",
    "fault_class",
    "fault_kinds",
    "parse_bit",
    "flip_bit",
]

_REGISTRY: dict[str, type[Fault]] = {}
_LOADED = threading.Lock()
_loaded = False


@dataclass(slots=True, kw_only=True)
class FaultContext:
    """One rank's view of the run, shared by the worker loop and its faults.

    ``step`` is the optimizer step in progress, with the collector's numbering;
    the worker advances it at the top of each iteration. ``report`` sends a
    small dict to the parent (it lands in ``meta.json`` under ``injections``).
    ``extra`` holds ``"device"`` (the ``DeviceClock``, before ``install``) and
    ``"collector"`` (the attached ``RankCollector``, once attached).
    """

    rank: int
    world: int
    host: str
    steps: int
    seed: int
    model: Any  # the bare torch module (not the DDP wrapper)
    optimizer: Any
    report: Callable[[dict], None]
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Fault:
    """Base class: a fault that does nothing (the ``none`` kind uses it as is)."""

    kind: ClassVar[str] = ""
    label_kind: ClassVar[str | None] = None  # trace-format label kind; None: no label
    params: ClassVar[dict[str, Callable[[str], Any]]] = {}
    required: ClassVar[tuple[str, ...]] = ()
    targets_rank: ClassVar[bool] = True
    # How the run ends when this fault fires: None (normally), "hang" or "crash".
    ends_run: ClassVar[str | None] = None
    # Default length of the faulty range when the spec gives no ``until``:
    # None means "to the end of the run", 0 means "that one step only".
    default_span: ClassVar[int | None] = None
    # Whether the damage outlives the faulty steps (e.g. a diverged replica),
    # in which case the label's ``until`` is null.
    persistent: ClassVar[bool] = False

    def __init__(self, spec: Any):  # a simulate.spec.FaultSpec (not imported: no loop)
        self.spec = spec

    def install(self, ctx: FaultContext) -> None:
        """Register hooks before the collector attaches."""

    def before_all_reduce(self, ctx: FaultContext, bucket: Any) -> None:
        """Called in the comm hook before this rank's bucket all-reduce is launched."""

    def after_all_reduce(self, ctx: FaultContext, bucket: Any, tensor: torch.Tensor):
        """Called with the reduced bucket; returns the tensor DDP will use."""
        return tensor

    def close(self, ctx: FaultContext) -> None:
        """The run ended normally."""

    def magnitude(self) -> float | None:
        """The size of the fault for the label (factor, seconds...), if it has one."""
        return None


def register_fault(cls: type[Fault]) -> type[Fault]:
    """Class decorator: make ``cls.kind`` usable in ``--fault`` specs."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    if cls.kind in _REGISTRY and _REGISTRY[cls.kind] is not cls:
        raise ValueError(f"fault kind {cls.kind!r} registered twice")
    _REGISTRY[cls.kind] = cls
    return cls


def _load_all() -> None:
    global _loaded
    with _LOADED:
        if _loaded:
            return
        # The sibling files of this one, found by path: no import of the package itself.
        for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
            if not mod.name.startswith("_") and mod.name != "base":
                importlib.import_module(f"{__package__}.{mod.name}")
        _loaded = True


def fault_class(kind: str) -> type[Fault]:
    """The class registered for ``kind``; KeyError when there is none."""
    _load_all()
    return _REGISTRY[kind]


def fault_kinds() -> list[str]:
    """Every registered kind, sorted."""
    _load_all()
    return sorted(_REGISTRY)


@register_fault
class NoFault(Fault):
    """``none``: a clean run (no label)."""

    kind = "none"
    targets_rank = False


# --- bit flips, shared by the corruption kinds -------------------------------

BIT_ALIASES = {"exponent": 30, "mantissa": 22, "sign": 31}


def parse_bit(value: str) -> int:
    """``exponent`` (bit 30), ``mantissa`` (bit 22), ``sign`` (31) or an index 0..31."""
    if value in BIT_ALIASES:
        return BIT_ALIASES[value]
    try:
        bit = int(value)
    except ValueError:
        raise ValueError("should be exponent, mantissa, sign or a bit index 0..31") from None
    if not 0 <= bit <= 31:
        raise ValueError("bit index should be within 0..31 (float32)")
    return bit


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip one bit of element ``index`` of a float32 tensor in place; returns (before, after)."""
    flat = tensor.view(-1)
    before = float(flat[index])
    (word,) = struct.unpack("<I", struct.pack("<f", before))
    (after,) = struct.unpack("<f", struct.pack("<I", word ^ (1 << bit)))
    flat[index] = after
    return before, after

"""Parsing ``--fault`` specs and ``--topology``, and the emulated cluster layout.

A fault spec is ``KIND[:key=value,key=value...]``, e.g.
``straggler:rank=3,from=120,factor=1.6``. Every kind takes ``rank`` (the
faulty rank), ``from`` (first faulty step) and ``until`` (last faulty step,
inclusive); each fault class adds its own keys (see ``faults/``). Parsing only
checks syntax and value types; ``SimConfig`` checks the values against the
run (rank < world, from < steps). Errors are ``SpecError`` with a message that
names the spec and says what is wrong, which the CLI prints as is.

Topology: the model is plain data-parallel, but the harness hands every rank
emulated coordinates so that host roll-up and peer groups are exercised.
Coordinates follow Megatron's order: ``tp`` varies fastest, then ``dp``, then
``pp``. Hosts are ``node00``, ``node01``... with ``ranks_per_host`` ranks each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SpecError",
    "FaultSpec",
    "parse_fault",
    "parse_topology",
    "rank_coords",
    "host_of",
]

COMMON_KEYS = ("rank", "from", "until")
TOPOLOGY_AXES = ("dp", "tp", "pp")


class SpecError(ValueError):
    """A fault spec or topology that cannot be used; the message says why."""


@dataclass(slots=True, kw_only=True)
class FaultSpec:
    """One parsed ``--fault``: kind, target rank, step range and the kind's own parameters.

    ``from_step``/``until_step`` are None when the spec leaves them to the
    run's defaults (``SimConfig`` resolves them); ``text`` is the spec exactly
    as given, kept for labels and meta.
    """

    kind: str
    text: str
    rank: int | None = None
    from_step: int | None = None
    until_step: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def active(self, rank: int, step: int) -> bool:
        """Whether this fault acts on ``rank`` at ``step``."""
        if rank != self.rank or self.from_step is None or step < self.from_step:
            return False
        return self.until_step is None or step <= self.until_step


def _parse_int(spec: str, key: str, value: str, minimum: int = 0) -> int:
    try:
        out = int(value)
    except ValueError:
        raise SpecError(f"fault {spec!r}: {key}={value!r} should be an integer") from None
    if out < minimum:
        raise SpecError(f"fault {spec!r}: {key}={out} should be >= {minimum}")
    return out


def parse_fault(text: str) -> FaultSpec:
    """Parse one ``--fault`` value; raises ``SpecError`` naming the problem."""
    from rankscope.pipeline.simulate.faults import fault_class, fault_kinds

    raw = text.strip()
    if not raw:
        raise SpecError("empty fault spec (expected KIND[:key=value,...])")
    kind, _, rest = raw.partition(":")
    kind = kind.strip()
    try:
        cls = fault_class(kind)
    except KeyError:
        known = ", ".join(fault_kinds())
        raise SpecError(f"fault {raw!r}: unknown kind {kind!r} (known kinds: {known})") from None
    spec = FaultSpec(kind=kind, text=raw)
    seen: set[str] = set()
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise SpecError(f"fault {raw!r}: {item!r} should be key=value")
        if key in seen:
            raise SpecError(f"fault {raw!r}: {key!r} given twice")
        seen.add(key)
        if key == "rank":
            spec.rank = _parse_int(raw, key, value)
        elif key == "from":
            spec.from_step = _parse_int(raw, key, value)
        elif key == "until":
            spec.until_step = _parse_int(raw, key, value)
        elif key in cls.params:
            try:
                spec.params[key] = cls.params[key](value)
            except ValueError as exc:
                raise SpecError(f"fault {raw!r}: {key}={value!r}: {exc}") from None
        else:
            accepted = ", ".join((*COMMON_KEYS, *cls.params)) if cls.targets_rank else "none"
            raise SpecError(f"fault {raw!r}: unknown parameter {key!r} (accepted: {accepted})")
    if not cls.targets_rank:
        if seen:
            raise SpecError(f"fault {raw!r}: kind {kind!r} takes no parameters")
        return spec
    if spec.rank is None:
        raise SpecError(f"fault {raw!r}: rank=N is required")
    if (
        spec.from_step is not None
        and spec.until_step is not None
        and spec.until_step < spec.from_step
    ):
        raise SpecError(f"fault {raw!r}: until={spec.until_step} is before from={spec.from_step}")
    for key in cls.required:
        if key not in spec.params:
            raise SpecError(f"fault {raw!r}: {key}= is required")
    return spec


def parse_topology(text: str | dict | None, world: int) -> dict[str, int]:
    """``"dp=2,tp=2,pp=2"`` (or a dict) -> sizes; missing axes are 1, dp fills the rest.

    The product must equal ``world``; with no topology every rank is a
    data-parallel replica (``dp = world``).
    """
    if text is None or text == "":
        return {"dp": world, "tp": 1, "pp": 1}
    if isinstance(text, dict):
        items = {str(k): str(v) for k, v in text.items()}
    else:
        items = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise SpecError(f"topology {text!r}: {part!r} should be axis=size")
            if key.strip() in items:
                raise SpecError(f"topology {text!r}: axis {key.strip()!r} given twice")
            items[key.strip()] = value.strip()
    sizes: dict[str, int] = {}
    for key, value in items.items():
        if key not in TOPOLOGY_AXES:
            raise SpecError(f"topology {text!r}: unknown axis {key!r} (axes: dp, tp, pp)")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise SpecError(f"topology {text!r}: {key}={value!r} should be an integer") from None
        if sizes[key] < 1:
            raise SpecError(f"topology {text!r}: {key} should be >= 1")
    tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
    if "dp" not in sizes:
        if world % (tp * pp):
            raise SpecError(f"topology {text!r}: tp*pp={tp * pp} does not divide {world} ranks")
        sizes["dp"] = world // (tp * pp)
    dp = sizes["dp"]
    if dp * tp * pp != world:
        raise SpecError(
            f"topology {text!r}: dp*tp*pp = {dp * tp * pp}, but there are {world} ranks"
        )
    return {"dp": dp, "tp": tp, "pp": pp}


def rank_coords(rank: int, topology: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank``: tp fastest, then dp, then pp (Megatron's order)."""
    tp, dp = topology["tp"], topology["dp"]
    return {"dp": (rank // tp) % dp, "tp": rank % tp, "pp": rank // (tp * dp)}


def host_of(rank: int, ranks_per_host: int) -> str:
    """The emulated host name of ``rank``: ``node00`` holds ranks 0..K-1, and so on."""
    return f"node{rank // ranks_per_host:02d}"

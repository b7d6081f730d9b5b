"""Who this rank is: global rank, world size, host and parallel coordinates.

Coordinates come from, in order of preference: the ``topology`` argument (a
dict or string of axis sizes such as ``"dp=2,tp=2,pp=1"``, or a torch
``DeviceMesh``), the environment variable ``RANKSCOPE_TOPOLOGY`` (same string
form), or plain data parallelism (``dp = rank``, ``tp = pp = 0``). From axis
sizes the rank's coordinates follow the Megatron-LM layout: ``tp`` varies
fastest, then ``cp``, ``ep``, ``dp``, and ``pp`` slowest. One size may be left
out when it is ``dp``: it is then the world size divided by the others.

The host is the hostname unless ``host=`` or ``RANKSCOPE_HOST`` says
otherwise (the fault harness emulates several hosts on one machine that way).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AXES", "Identity", "parse_topology", "coordinates", "resolve_identity"]

# Fastest-varying first.
AXES = ("tp", "cp", "ep", "dp", "pp")
TOPOLOGY_ENV = "RANKSCOPE_TOPOLOGY"
log = logging.getLogger("rankscope.collectors")
HOST_ENV = "RANKSCOPE_HOST"


@dataclass(slots=True)
class Identity:
    """This rank's place in the job, stamped on every record."""

    rank: int
    world: int
    host: str
    coords: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    # process groups by axis name, when known (a DeviceMesh provides them)
    groups: dict[str, Any] = field(default_factory=dict)
    assumed: list[str] = field(default_factory=list)  # guesses made for unnamed mesh dims


def parse_topology(spec: str | dict, world: int | None = None) -> dict[str, int]:
    """Axis sizes from ``"dp=2,tp=2,pp=1"`` or ``{"dp": 2, ...}``; checked against ``world``."""
    if isinstance(spec, str):
        sizes: dict[str, Any] = {}
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"topology {spec!r}: expected AXIS=SIZE, got {part!r}")
            sizes[name] = value
    elif isinstance(spec, dict):
        sizes = dict(spec)
    else:
        raise ValueError(
            f"topology must be a string, dict or DeviceMesh, got {type(spec).__name__}"
        )
    out: dict[str, int] = {}
    for name, value in sizes.items():
        if name not in AXES:
            raise ValueError(f"topology {spec!r}: unknown axis {name!r} (known: {', '.join(AXES)})")
        try:
            size = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"topology {spec!r}: size of {name!r} is not an integer") from None
        if size < 1:
            raise ValueError(f"topology {spec!r}: size of {name!r} must be >= 1")
        out[name] = size
    if world is not None:
        others = 1
        for name, size in out.items():
            if name != "dp":
                others *= size
        if "dp" not in out:
            if world % others:
                raise ValueError(
                    f"topology {spec!r}: world size {world} is not divisible by {others}"
                )
            out["dp"] = world // others
        if others * out["dp"] != world:
            raise ValueError(
                f"topology {spec!r}: sizes multiply to {others * out['dp']}, world size is {world}"
            )
    return out


def coordinates(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """The coordinate of ``rank`` on every axis (tp fastest, pp slowest)."""
    coords: dict[str, int] = {}
    rest = rank
    for axis in AXES:
        size = sizes.get(axis, 1)
        coords[axis] = rest % size
        rest //= size
    # tp and pp always appear; cp and ep only when the job has them
    return {a: c for a, c in coords.items() if a in ("dp", "tp", "pp") or a in sizes}


# mesh dimension names (torchtitan, FSDP/HSDP examples) -> axis
_DIM_AXES = {
    "dp_replicate": "dp",
    "dp_shard": "dp",
    "dp_shard_cp": "dp",
    "fsdp": "dp",
    "hsdp": "dp",
    "ddp": "dp",
    "replicate": "dp",
    "shard": "dp",
    "data": "dp",
    "data_parallel": "dp",
    "tensor": "tp",
    "tensor_parallel": "tp",
    "pipeline": "pp",
    "pipeline_parallel": "pp",
    "context": "cp",
    "expert": "ep",
}


def _mesh_axes(mesh: Any, dp_groups: list[Any]) -> tuple[list[str], list[str]]:
    """The axis of every mesh dimension, and the assumptions made for unnamed ones.

    Named dimensions map by name. Unnamed ones: a dimension whose process
    group is one the model reduces gradients over (FSDP, DDP) is ``dp``; of the
    rest, the first is ``dp`` when no dp was found, the others ``tp`` (the
    torchtitan order: data parallel outer, tensor parallel inner)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    dp_keys = {str(getattr(g, "group_name", id(g))) for g in dp_groups}
    axes: list[str | None] = []
    for i in range(mesh.ndim):
        name = names[i] if i < len(names) else None
        axis = _DIM_AXES.get(name, name) if name else None
        if axis is not None and axis not in AXES:
            raise ValueError(
                f"DeviceMesh dimension {name!r} is not a known axis "
                f"(known: {', '.join(AXES)} and {', '.join(sorted(_DIM_AXES))})"
            )
        if axis is None:
            try:
                g = mesh.get_group(i)
                if str(getattr(g, "group_name", id(g))) in dp_keys:
                    axis = "dp"
            except Exception:
                pass
        axes.append(axis)
    assumed = []
    for i, a in enumerate(axes):
        if a is None:
            axes[i] = "dp" if "dp" not in axes else "tp"
            assumed.append(f"dimension {i} (size {mesh.size(i)}) taken as {axes[i]}")
    return axes, assumed  # type: ignore[return-value]


def _from_mesh(
    mesh: Any, dp_groups: list[Any] | None = None
) -> tuple[dict[str, int], dict[str, int], dict[str, Any], list[str]]:
    """Sizes, coordinates and named groups from a DeviceMesh. Several dimensions of
    one axis (HSDP's replicate and shard) flatten into it, outer dimension first."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the given DeviceMesh")
    axes, assumed = _mesh_axes(mesh, dp_groups or [])
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    sizes: dict[str, int] = {}
    coords = {"dp": 0, "tp": 0, "pp": 0}
    groups: dict[str, Any] = {}
    for i, axis in enumerate(axes):
        size = mesh.size(i)
        coords[axis] = coords.get(axis, 0) * size + int(coord[i]) if axis in sizes else int(
            coord[i]
        )
        sizes[axis] = sizes.get(axis, 1) * size
        try:
            groups[names[i] if i < len(names) else axis] = mesh.get_group(i)
        except Exception:  # a mesh without process groups for this dim
            pass
    return sizes, coords, groups, assumed


def _dist_rank_world() -> tuple[int | None, int | None]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None, None


def _parallel_dims(obj: Any) -> dict[str, int] | None:
    """Axis sizes from a torchtitan ``ParallelDims``-like object (``dp_replicate``,
    ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep`` attributes) or a Megatron-style
    one (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``context_parallel_size``, ``expert_model_parallel_size``); None otherwise.
    A size of -1 or None (torchtitan: "the rest") is left for dp to take."""
    if isinstance(obj, (str, dict)) or obj is None:
        return None
    titan = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    megatron = {
        "tensor_model_parallel_size": "tp",
        "pipeline_model_parallel_size": "pp",
        "context_parallel_size": "cp",
        "expert_model_parallel_size": "ep",
    }
    if all(hasattr(obj, a) for a in ("dp_shard", "tp", "pp")):
        raw = {a: getattr(obj, a, 1) for a in titan}
        dp_parts = [raw.pop("dp_replicate"), raw.pop("dp_shard")]
        sizes = {a: int(v) for a, v in raw.items() if v not in (None, -1) and int(v) > 1}
        if all(v not in (None, -1) for v in dp_parts):
            sizes["dp"] = int(dp_parts[0]) * int(dp_parts[1])
        sizes.pop("ep", None)  # torchtitan's ep borrows dp ranks; not a separate axis
        return sizes
    if any(hasattr(obj, a) for a in megatron):
        return {
            axis: int(getattr(obj, a))
            for a, axis in megatron.items()
            if getattr(obj, a, None) not in (None, 1)
        }
    return None


def resolve_identity(
    *,
    rank: int | None,
    world: int | None,
    host: str | None,
    topology: Any,
    dp_groups: list[Any] | None = None,
    mesh: Any = None,
) -> Identity:
    """Fill in rank, world, host and coordinates from arguments, torch.distributed and env."""
    d_rank, d_world = _dist_rank_world()
    if rank is None:
        rank = d_rank if d_rank is not None else int(os.environ.get("RANK", 0))
    if world is None:
        world = d_world if d_world is not None else int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    host = host or os.environ.get(HOST_ENV) or socket.gethostname()
    ident = Identity(rank=rank, world=world, host=host)
    if topology is None:
        topology = os.environ.get(TOPOLOGY_ENV) or None
    if topology is None and mesh is not None:
        topology = mesh  # the DTensor parameters' mesh: better than dp = rank
    if topology is None:
        ident.sizes = {"dp": world}
        ident.coords = {"dp": rank, "tp": 0, "pp": 0}
    elif hasattr(topology, "get_coordinate") and hasattr(topology, "mesh_dim_names"):
        ident.sizes, ident.coords, ident.groups, ident.assumed = _from_mesh(topology, dp_groups)
        if ident.assumed:
            log.warning(
                "rankscope collector: DeviceMesh without dimension names: %s; pass "
                "topology='dp=..,tp=..' or name the mesh dimensions to say otherwise",
                "; ".join(ident.assumed),
            )
    elif _parallel_dims(topology) is not None:
        ident.sizes = parse_topology(_parallel_dims(topology), world)
        ident.coords = coordinates(ident.sizes, rank)
    else:
        ident.sizes = parse_topology(topology, world)
        ident.coords = coordinates(ident.sizes, rank)
    return ident

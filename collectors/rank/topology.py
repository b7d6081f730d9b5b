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

import os
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AXES", "Identity", "parse_topology", "coordinates", "resolve_identity"]

# Fastest-varying first.
AXES = ("tp", "cp", "ep", "dp", "pp")
TOPOLOGY_ENV = "RANKSCOPE_TOPOLOGY"
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


def _from_mesh(mesh: Any) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    names = tuple(mesh.mesh_dim_names or ())
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the given DeviceMesh")
    sizes, coords, groups = {}, {"dp": 0, "tp": 0, "pp": 0}, {}
    for i, name in enumerate(names):
        axis = {"dp_replicate": "dp", "dp_shard": "dp"}.get(name, name)
        if axis not in AXES:
            continue
        sizes[axis] = mesh.size(i)
        coords[axis] = int(coord[i])
        try:
            groups[axis] = mesh.get_group(name)
        except Exception:  # a mesh without process groups for this dim
            pass
    return sizes, coords, groups


def _dist_rank_world() -> tuple[int | None, int | None]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None, None


def resolve_identity(
    *, rank: int | None, world: int | None, host: str | None, topology: Any
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
    if topology is None:
        ident.sizes = {"dp": world}
        ident.coords = {"dp": rank, "tp": 0, "pp": 0}
    elif hasattr(topology, "get_coordinate") and hasattr(topology, "mesh_dim_names"):
        ident.sizes, ident.coords, ident.groups = _from_mesh(topology)
    else:
        ident.sizes = parse_topology(topology, world)
        ident.coords = coordinates(ident.sizes, rank)
    return ident

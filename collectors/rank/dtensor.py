"""DTensor parameters (FSDP2, tensor parallel): their local part and who else holds it.

Under ``fully_shard`` and ``parallelize_module`` a parameter is a DTensor:
a local tensor plus a mesh and one placement per mesh dimension. Everything
the collector reads per rank (gradient norms, the parameter digest) must be
read from the LOCAL tensor: a torch op on the DTensor itself dispatches a
collective (a norm becomes a global norm, equal on every rank) or fails
(``.numpy()`` on a tensor subclass).

``replica_layout`` answers, for the digest, which ranks must hold the very
same local bytes: along a data-parallel mesh dimension where every
parameter is ``Replicate`` (HSDP's replicate dimension) the local parts are
replicas; along one where a parameter is sharded (FSDP's shard dimension)
they are different by design. The rank's coordinates on the sharded
data-parallel dimensions, flattened, are its ``shard``: ranks with the same
``shard`` and the same non-dp coordinates are replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReplicaLayout", "is_dtensor", "local", "replica_layout"]


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind ``t`` (``t`` itself when it is a plain tensor)."""
    return t._local_tensor if is_dtensor(t) else t


@dataclass(slots=True)
class ReplicaLayout:
    """What the parameters' placements say about replicas along data parallelism."""

    shard: int | None  # this rank's shard index among its dp peers (None: not sharded)
    shards: int  # how many different shards the dp peers hold (1: all replicas)
    replicas: int  # dp peers holding this rank's very shard, itself included


def _group_key(group: Any) -> str:
    return str(getattr(group, "group_name", None) or id(group))


def replica_layout(params: list[torch.Tensor], dp_groups: list[Any]) -> ReplicaLayout | None:
    """The data-parallel layout of DTensor ``params`` over ``dp_groups`` (the groups
    FSDP or DDP reduce gradients over); None when no parameter is a DTensor.

    A dp group is sharded when some parameter is not ``Replicate`` on a mesh
    dimension of that group; a dp group no DTensor mesh dimension covers (DDP
    around a tensor-parallel module) holds replicas."""
    dts = [p for p in params if is_dtensor(p)]
    if not dts:
        return None
    groups = {_group_key(g): g for g in dp_groups}
    sharded: set[str] = set()
    meshes = {id(p.device_mesh): p.device_mesh for p in dts}
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            try:
                key = _group_key(mesh.get_group(dim))
            except Exception:
                continue
            if key not in groups:
                continue  # a tensor-parallel (or other model-parallel) dimension
            if any(p.device_mesh is mesh and not p.placements[dim].is_replicate() for p in dts):
                sharded.add(key)
    shard, shards, replicas = 0, 1, 1
    for key, g in groups.items():  # the callers' order, the same on every rank
        if key in sharded:
            shard, shards = shard * g.size() + g.rank(), shards * g.size()
        else:
            replicas *= g.size()
    return ReplicaLayout(shard=shard if sharded else None, shards=shards, replicas=replicas)

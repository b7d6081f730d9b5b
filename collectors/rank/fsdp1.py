"""FSDP1 (the ``FullyShardedDataParallel`` wrapper): its groups and its local gradient.

Lightning's ``FSDPStrategy``, Accelerate's FSDP plugin and the HF ``Trainer``
still build FSDP1. Each wrapped unit reduces its flat gradient with one
``reduce_scatter_single`` over its process group (under ``HYBRID_SHARD``, then
one ``all_reduce`` of the shard across nodes), or, under ``NO_SHARD``, one
``all_reduce`` of the whole flat gradient. The input of that first reduction
is this rank's own gradient: ``grad_norm`` is taken there by the same tap as
FSDP2's (``fsdp.GradInputTap``, called by ``dist_wrap`` just before the call).

FSDP1 divides the input by its pre-divide factor before reducing it, for
every dtype (about the square root of the group size; the rest is divided
after), so the tap multiplies the norm back by the unit's
``_gradient_predivide_factor``. FSDP1 also has a ``register_comm_hook`` of its
own, with another signature: the collector never registers its DDP hook
there (``wrappers.py``), and leaves FSDP's default reduction untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.fsdp import GradInputTap, group_key
from rankscope.collectors.rank.step_state import StepState

__all__ = ["Fsdp1Groups", "find_fsdp1", "fsdp1_taps"]


@dataclass(slots=True)
class Fsdp1Groups:
    """The process groups FSDP1 units reduce gradients over, and how."""

    shard: list[Any] = field(default_factory=list)  # the units' own process groups
    replicate: list[Any] = field(default_factory=list)  # HYBRID_SHARD: across nodes
    predivide: dict[str, float] = field(default_factory=dict)  # group key -> factor
    strategy: str = ""  # the root's ShardingStrategy name
    units: int = 0

    @property
    def sharded(self) -> bool:
        """Each rank holds its own slice of the parameters (nothing replicated whole)."""
        return self.strategy != "NO_SHARD"

    def dp_groups(self) -> list[Any]:
        return self.replicate + self.shard


def find_fsdp1(model: torch.nn.Module) -> Fsdp1Groups | None:
    """The groups of ``model``'s FSDP1 units; None when it has none."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    found = Fsdp1Groups()
    for m in model.modules():
        if not isinstance(m, FullyShardedDataParallel):
            continue
        found.units += 1
        if not found.strategy:
            found.strategy = getattr(getattr(m, "sharding_strategy", None), "name", "")
        pg = getattr(m, "process_group", None)
        if pg is not None and group_key(pg) not in found.predivide:
            found.shard.append(pg)
            found.predivide[group_key(pg)] = float(getattr(m, "_gradient_predivide_factor", 1.0))
        inter = getattr(m, "_inter_node_pg", None)
        if inter is not None and all(group_key(inter) != group_key(g) for g in found.replicate):
            found.replicate.append(inter)
    return found if found.units else None


def fsdp1_taps(
    fsdp1: Fsdp1Groups, state: StepState, faults: Faults, self_time: Any
) -> dict[str, GradInputTap]:
    """The ``dist_wrap`` tap on FSDP1's first gradient reduction: the reduce-scatter's
    input, or under ``NO_SHARD`` the all-reduce's."""
    groups = {group_key(g): fsdp1.predivide[group_key(g)] for g in fsdp1.shard}
    factor = lambda pre, inp: pre  # noqa: E731 (the group's pre-divide, any dtype)
    if fsdp1.sharded:
        return {"reduce_scatter_single": GradInputTap(state, groups, faults, self_time,
                                                      factor=factor)}  # fmt: skip
    return {"all_reduce": GradInputTap(state, groups, faults, self_time, arg=("tensor", 0),
                                       factor=factor)}  # fmt: skip

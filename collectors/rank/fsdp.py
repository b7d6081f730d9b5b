"""FSDP2 (``fully_shard``, HSDP): where its groups are and where the local gradient is.

FSDP2 reduces each parameter group's gradient with one
``reduce_scatter_single`` over its shard group (and, under HSDP, one
``all_reduce`` of the reduced shard over the replicate group). The
reduce-scatter's INPUT is the unsharded gradient this rank computed, the
only moment the rank's local contribution exists whole: ``grad_norm`` is
taken there (``ReduceScatterTap``, called by ``dist_wrap`` just before the
call). After the step's reductions ``.grad`` holds this rank's shard of the
reduced gradient; ``grad_norm_reduced`` is that shard's norm, equal on
HSDP replicas of one shard.

FSDP pre-divides the input only for reduce dtypes at risk of overflow
(float16); there ``grad_norm`` is the local gradient divided by that factor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_stats import tensor_norm_stats
from rankscope.collectors.rank.step_state import StepState

__all__ = ["FsdpGroups", "ReduceScatterTap", "find_fsdp"]


@dataclass(slots=True)
class FsdpGroups:
    """The process groups FSDP2 reduces gradients over, in the model (deduplicated)."""

    shard: list[Any] = field(default_factory=list)
    replicate: list[Any] = field(default_factory=list)
    modules: int = 0

    def dp_groups(self) -> list[Any]:
        return self.replicate + self.shard


def _key(group: Any) -> str:
    return str(getattr(group, "group_name", None) or id(group))


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return list(groups)


def find_fsdp(model: torch.nn.Module) -> FsdpGroups | None:
    """The FSDP2 groups of ``model``'s ``fully_shard`` modules; None when there are none.

    Raises what the FSDP internals raise when their layout has changed: the
    caller says so at WARNING and falls back to the mesh dimension names."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    found = FsdpGroups()
    seen: set[str] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        found.modules += 1
        for pg in _param_groups(m._get_fsdp_state()):
            info = pg.mesh_info
            for attr, into in (("shard_process_group", found.shard),
                               ("replicate_process_group", found.replicate)):
                g = getattr(info, attr, None)
                if g is not None and _key(g) not in seen:
                    seen.add(_key(g))
                    into.append(g)
    return found if found.modules else None


class ReduceScatterTap:
    """Takes the local gradient norm from FSDP's reduce-scatter inputs (training thread)."""

    def __init__(
        self, state: StepState, shard_groups: list[Any], faults: Faults, self_time: Any = None
    ) -> None:
        self._state = state
        self._self_time = self_time  # SelfTime: the pass counts as grad_norm_s
        self._keys = {_key(g) for g in shard_groups}
        self._faults = faults

    def __call__(self, args: tuple, kwargs: dict, group: Any) -> None:
        if group is None or _key(group) not in self._keys:
            return  # a reduce-scatter that is not FSDP's gradient reduction
        try:
            inp = kwargs.get("input")
            if inp is None and len(args) > 1:
                inp = args[1]
            if not isinstance(inp, torch.Tensor):
                return
            t0 = time.perf_counter()
            norm, nonfinite = tensor_norm_stats(inp)
            if self._self_time is not None:
                self._self_time.grad_norm_s += time.perf_counter() - t0
            self._state.local_sq.append(norm)
            self._state.nonfinite.append(nonfinite)
            self._state.fsdp_reductions += 1
        except Exception as exc:
            self._faults.hit("grad_norm (FSDP reduce-scatter input)", exc)

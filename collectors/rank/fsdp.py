"""FSDP2 (``fully_shard``, HSDP): where its groups are and where the local gradient is.

FSDP2 reduces each parameter group's gradient with one
``reduce_scatter_single`` over its shard group (and, under HSDP, one
``all_reduce`` of the reduced shard over the replicate group). The
reduce-scatter's INPUT is the unsharded gradient this rank computed, the
only moment the rank's local contribution exists whole: ``grad_norm`` is
taken there (``GradInputTap``, called by ``dist_wrap`` just before the
call). After the step's reductions ``.grad`` holds this rank's shard of the
reduced gradient; ``grad_norm_reduced`` is that shard's norm, equal on
HSDP replicas of one shard.

With a shard group of one rank (HSDP of whole replicas: plain data parallel
through ``fully_shard``, as under pipeline stages) there is no reduce-scatter;
the replicate all-reduce's input is then the local gradient, and the tap is
on that all-reduce instead.

FSDP pre-divides the input for reduce dtypes at risk of overflow (float16,
by ~sqrt of the divide factor, ``set_gradient_divide_factor`` or the data
parallel size); the tap multiplies the norm back by that pre-divide factor,
asked of FSDP's own rule, so ``grad_norm`` is the gradient this rank computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_stats import tensor_norm_stats
from rankscope.collectors.rank.step_state import StepState

__all__ = ["FsdpGroups", "GradInputTap", "find_fsdp", "fsdp_taps", "group_key"]


@dataclass(slots=True)
class FsdpGroups:
    """The process groups FSDP2 reduces gradients over, in the model (deduplicated)."""

    shard: list[Any] = field(default_factory=list)
    replicate: list[Any] = field(default_factory=list)
    modules: int = 0
    by_group: dict[str, Any] = field(default_factory=dict)  # group key -> an FSDPParamGroup

    def dp_groups(self) -> list[Any]:
        return self.replicate + self.shard


def group_key(group: Any) -> str:
    """A process group's key: its name (or, without one, its identity)."""
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
                if g is not None:
                    found.by_group.setdefault(group_key(g), pg)
                if g is not None and group_key(g) not in seen:
                    seen.add(group_key(g))
                    into.append(g)
    return found if found.modules else None


def _predivide(pg: Any, inp: torch.Tensor) -> float:
    """The factor FSDP divided ``inp`` by before reducing it (1.0 when none)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    info = pg.mesh_info
    pre = _get_gradient_divide_factors(
        getattr(info, "shard_process_group", None),
        getattr(info, "replicate_process_group", None),
        inp.dtype,
        inp.device.type,
        getattr(pg, "gradient_divide_factor", None),
        getattr(pg, "force_sum_reduction_for_comms", False),
    )[0]
    return float(pre) if pre else 1.0


class GradInputTap:
    """Takes the local gradient norm from the input of FSDP's first gradient
    reduction: the reduce-scatter, or the replicate all-reduce where the shard
    group is one rank (training thread, just before the call). ``groups``: group
    key -> what ``factor`` (or FSDP2's rule) reads the pre-divide factor from."""

    def __init__(
        self,
        state: StepState,
        groups: dict[str, Any],
        faults: Faults,
        self_time: Any = None,
        arg: tuple[str, int] = ("input", 1),
        factor: Any = None,
    ) -> None:
        self._state = state
        self._self_time = self_time  # SelfTime: the pass counts as grad_norm_s
        self._groups = groups  # group key -> FSDPParamGroup reducing over it
        self._faults = faults
        self._arg = arg
        self._factor_of = factor  # (group's entry, input) -> pre-divide; None: FSDP2's rule
        self._warned_factor = False

    def __call__(self, args: tuple, kwargs: dict, group: Any) -> None:
        pg = None if group is None else self._groups.get(group_key(group))
        if pg is None:
            return  # a reduction that is not FSDP's gradient reduction
        try:
            name, pos = self._arg
            inp = kwargs.get(name)
            if inp is None and len(args) > pos:
                inp = args[pos]
            if not isinstance(inp, torch.Tensor):
                return
            t0 = time.perf_counter()
            norm, nonfinite = tensor_norm_stats(inp)
            factor = self._factor(pg, inp)
            if factor != 1.0:
                norm = norm * factor
            if self._self_time is not None:
                self._self_time.grad_norm_s += time.perf_counter() - t0
            self._state.local_sq.append(norm)
            self._state.nonfinite.append(nonfinite)
            self._state.tapped_reductions += 1
        except Exception as exc:
            self._faults.hit("grad_norm (FSDP reduction input)", exc)

    def _factor(self, pg: Any, inp: torch.Tensor) -> float:
        if self._factor_of is not None:
            return float(self._factor_of(pg, inp))
        if inp.dtype in (torch.float32, torch.bfloat16, torch.float64):
            return 1.0  # FSDP divides only where float16 could overflow
        try:
            return _predivide(pg, inp)
        except Exception as exc:
            if not self._warned_factor:
                self._warned_factor = True
                self._faults.hit("grad_norm (FSDP pre-divide factor; norm left divided)", exc)
            return 1.0


def fsdp_taps(
    fsdp: FsdpGroups, state: StepState, faults: Faults, self_time: Any
) -> dict[str, GradInputTap]:
    """The ``dist_wrap`` taps for ``fsdp``'s groups: reduce-scatter inputs over shard
    groups of several ranks; the replicate all-reduce's where a shard group is one."""
    def keyed(groups: list) -> dict[str, Any]:
        keys = (group_key(g) for g in groups)
        return {k: fsdp.by_group[k] for k in keys if k in fsdp.by_group}

    whole = [g for g in fsdp.shard if g.size() > 1]
    taps = {"reduce_scatter_single": GradInputTap(state, keyed(whole), faults, self_time)}
    if len(whole) < len(fsdp.shard) and fsdp.replicate:
        taps["all_reduce"] = GradInputTap(
            state, keyed(fsdp.replicate), faults, self_time, arg=("tensor", 0)
        )
    return taps

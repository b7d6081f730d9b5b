"""What the model is wrapped in, and what that means for each field.

Attach looks at the model once: DDP (a communication hook gives the local
gradient), FSDP2 ``fully_shard`` / HSDP (the reduce-scatter input gives it,
``fsdp.py``), DTensor tensor parallelism (local parts, functional
collectives), a ``torch.compile`` wrapper (hooks go on the module it
compiled), a pipeline stage. What it cannot collect there, or a wrapper it
does not know, it says once at WARNING at attach, naming the fields; the
records still flow with the fields it has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from rankscope.collectors.rank.dtensor import ReplicaLayout, is_dtensor, replica_layout
from rankscope.collectors.rank.fsdp import FsdpGroups, find_fsdp
from rankscope.collectors.rank.fsdp1 import Fsdp1Groups, find_fsdp1

__all__ = ["LoopShape", "hookable_optimizer", "inspect_model", "resumed_step", "stage_parts"]

log = logging.getLogger("rankscope.collectors")

# Wrappers whose gradient reduction the collector does not see (class names, so
# that nothing here imports them): the local gradient is gone by the time
# ``.grad`` is read.
_UNKNOWN = {
    "DeepSpeedEngine": "DeepSpeed",
}


# attributes through which optimizer wrappers hold the torch optimizer they step:
# Accelerate's AcceleratedOptimizer (``.optimizer``), Lightning's LightningOptimizer
# (``._optimizer``)
_INNER_OPTIMIZER = ("optimizer", "_optimizer")


def hookable_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose step hooks run: ``optimizer`` itself, or the one a
    wrapper holds (a wrapper built without ``Optimizer.__init__`` has no hooks of its
    own, and under gradient accumulation steps its inner optimizer only on real
    updates, which is the step boundary wanted). ``ValueError`` when there is none."""
    found = optimizer
    for _ in range(4):
        if isinstance(found, torch.optim.Optimizer) and hasattr(found, "_optimizer_step_pre_hooks"):
            return found
        inner = next((getattr(found, a) for a in _INNER_OPTIMIZER
                      if getattr(found, a, None) is not None), None)  # fmt: skip
        if inner is None:
            break
        found = inner
    raise ValueError(
        f"optimizer: a {type(optimizer).__name__} is not a torch.optim.Optimizer and holds "
        "none (as .optimizer or ._optimizer); pass the torch optimizer that steps"
    )


def stage_parts(model: Any) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The module to inspect, and the modules whose forwards the step's compute starts
    with. A pipeline rank that holds several stages (an interleaved or looped
    schedule; torchtitan's ``model_parts``) passes them as a list or ``ModuleList``:
    the schedule calls each part, never the list, so the forward hooks go on the
    parts. ``ValueError`` for what is not a module or a list of them."""
    if isinstance(model, (list, tuple)) and model:
        if not all(isinstance(m, torch.nn.Module) for m in model):
            raise ValueError("model: a list must hold modules (the rank's pipeline stages)")
        model = torch.nn.ModuleList(model)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: a {type(model).__name__} is not a torch.nn.Module or a "
                         "non-empty list of them")  # fmt: skip
    if isinstance(model, torch.nn.ModuleList) and len(model):
        return model, list(model)
    return model, [model]


def resumed_step(optimizer: Any) -> int:
    """The optimizer steps already taken, by its state (Adam-family optimizers count
    them per parameter; the largest count): a job restored from a checkpoint goes on
    numbering its steps from there, as on every replica, instead of from 0, whose
    records the pipeline would drop as late for the job's whole first run length.
    0 where the state keeps no count (plain SGD) or there is no optimizer."""
    best = 0
    try:  # a container's (torchtitan's, one optimizer per model part) are its parts'
        for opt in [optimizer, *(getattr(optimizer, "optimizers", None) or ())]:
            for st in getattr(opt, "state", {}).values():
                step = st.get("step") if isinstance(st, dict) else None
                if step is not None:
                    best = max(best, int(step.item() if torch.is_tensor(step) else step))
    except Exception as exc:  # a state it cannot read: number from 0, say why
        log.warning("rankscope collector: optimizer step count unreadable (%s): steps "
                    "are numbered from 0; pass start_step= to attach", exc)  # fmt: skip
        return 0
    return best


@dataclass(slots=True)
class LoopShape:
    """The wrappers found around the model and what follows for the fields."""

    module: torch.nn.Module  # the module to hook (under a torch.compile wrapper)
    ddp: bool = False
    fsdp: FsdpGroups | None = None
    fsdp1: Fsdp1Groups | None = None  # the FullyShardedDataParallel wrapper (fsdp1.py)
    dtensor: bool = False
    compiled: bool = False
    tp: bool = False  # a DTensor mesh dimension other than data parallel (tensor parallel)
    layout: ReplicaLayout | None = None
    dp_groups: list[Any] = field(default_factory=list)  # groups gradients are reduced over
    mesh: Any = None  # the DTensor parameters' mesh when it spans the world
    digest: bool = True  # param_digest compares replicas (False: nothing replicated)
    private: frozenset[int] = frozenset()  # ids of parameters no replica shares (DDP ignores)
    missing: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        parts = []
        if self.ddp:
            parts.append("DDP")
        if self.fsdp is not None:
            parts.append("HSDP" if self.fsdp.replicate else "FSDP2")
        if self.fsdp1 is not None:
            parts.append(f"FSDP1 {self.fsdp1.strategy}".rstrip())
        if self.tp:
            parts.append("TP")
        return "+".join(parts) or "plain"


def _ddp_private(shape: LoopShape, ddp: Any) -> None:
    """Parameters DDP was told to leave alone (``parameters_to_ignore``: a mixture of
    experts' own experts, say) are not replicas: kept out of the digest and the
    reduced norm, said once."""
    names = set(getattr(ddp, "parameters_to_ignore", None) or ())
    inner = getattr(ddp, "module", None)
    if not names or inner is None:
        return
    private = [p for n, p in inner.named_parameters() if n in names]
    if not private:
        return
    shape.private = frozenset(id(p) for p in private)
    shape.missing.append(
        f"param_digest, grad_norm_reduced: the {len(private)} parameters DDP ignores "
        "(each rank's own, e.g. experts) are left out; the replica votes do not cover them"
    )


def _dp_groups_of_ddp(model: Any) -> list[Any]:
    g = getattr(model, "process_group", None)
    if g is None:
        import torch.distributed as dist

        g = dist.group.WORLD if dist.is_initialized() else None
    return [g] if g is not None else []


def _has_model_parallel_dim(params: list[torch.Tensor], dp_groups: list[Any]) -> bool:
    keys = {str(getattr(g, "group_name", id(g))) for g in dp_groups}
    for p in params:
        if is_dtensor(p):
            mesh = p.device_mesh
            for dim in range(mesh.ndim):
                try:
                    g = mesh.get_group(dim)
                except Exception:
                    continue
                if str(getattr(g, "group_name", id(g))) not in keys:
                    return True
    return False


def _world_mesh(params: list[torch.Tensor]) -> Any:
    """The largest DTensor mesh among ``params``, if it spans every rank."""
    meshes = [p.device_mesh for p in params if is_dtensor(p)]
    if not meshes:
        return None
    mesh = max(meshes, key=lambda m: m.size())
    try:
        import torch.distributed as dist

        if dist.is_initialized() and mesh.size() != dist.get_world_size():
            return None
    except Exception:
        return None
    return mesh


def _inspect_fsdp1(shape: LoopShape, target: Any) -> None:
    try:
        shape.fsdp1 = find_fsdp1(target)
    except Exception as exc:
        shape.missing.append(f"FSDP1 internals not understood ({exc}): grad_norm is lost")
        return
    if shape.fsdp1 is None:
        return
    shape.dp_groups = shape.fsdp1.dp_groups()
    if shape.fsdp1.sharded:
        shape.digest = False
        shape.missing.append(
            f"param_digest: under FSDP1 {shape.fsdp1.strategy} every rank holds its own "
            "slice of the parameters, nothing whole is replicated to compare; left out (the "
            "timing, local-norm and NaN checks still hold)"
        )


def inspect_model(model: torch.nn.Module, params: list[torch.Tensor]) -> LoopShape:
    """Find the wrappers; log one WARNING naming what is missing (if anything)."""
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    shape = LoopShape(module=model, compiled=isinstance(inner, torch.nn.Module))
    target = inner if shape.compiled else model
    # DDP itself (or a subclass): FSDP1 has a register_comm_hook too, with another
    # hook signature, and a DDP hook registered there raises in its backward
    shape.ddp = isinstance(target, torch.nn.parallel.DistributedDataParallel)
    shape.dtensor = any(is_dtensor(p) for p in params)
    for m in [target, *getattr(target, "modules", lambda: [])()]:
        why = _UNKNOWN.get(type(m).__name__)
        if why:
            shape.missing.append(
                f"{why}: its gradient reduction is not seen, grad_norm is taken from "
                ".grad after the reduction and comm_s misses it"
            )
            break
    if shape.ddp:
        _ddp_private(shape, target)
    else:
        _inspect_fsdp1(shape, target)
    if shape.dtensor:
        try:
            shape.fsdp = find_fsdp(target)
        except Exception as exc:
            shape.missing.append(f"FSDP2 internals not understood ({exc}): grad_norm is lost")
        groups = shape.fsdp.dp_groups() if shape.fsdp else list(shape.dp_groups)  # or FSDP1
        if shape.ddp:
            groups += _dp_groups_of_ddp(target)
        shape.dp_groups = groups
        shape.tp = _has_model_parallel_dim(params, groups)
        shape.mesh = _world_mesh(params)
        shape.layout = replica_layout(params, groups)
        lay = shape.layout
        if lay is not None and lay.shard is not None and lay.replicas <= 1:
            shape.digest = False
            shape.missing.append(
                "param_digest: every data-parallel rank holds its own parameter shard, "
                "nothing is replicated to compare; left out (the timing, local-norm and NaN "
                "checks still hold)"
            )
        if not groups:
            shape.missing.append(
                "grad_norm_reduced: no data-parallel reduction found (tensor parallel "
                "only); grad_norm is this rank's local shard"
            )
    if shape.missing:
        log.warning(
            "rankscope collector (%s%s): not collected: %s",
            shape.name,
            ", torch.compile" if shape.compiled else "",
            "; ".join(shape.missing),
        )
    return shape

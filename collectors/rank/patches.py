"""The patches one collector installs into torch at attach, built in one place.

AMP's scaler, ``torch.distributed``'s collectives (with the taps that read a
gradient before its reduction: FSDP2's, FSDP1's, a plain loop's own all-reduce),
``Work.wait``, DTensor's functional collectives, the loop's gradient clipping,
a pipeline's metadata inference and ``torch.autograd.backward`` (the loss);
each installs itself and restores torch at close (``uninstall``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rankscope.collectors.rank.amp import ScalerPatch
from rankscope.collectors.rank.clip_patch import ClipPatch
from rankscope.collectors.rank.dist_wrap import DistPatch, group_label
from rankscope.collectors.rank.fsdp import fsdp_taps
from rankscope.collectors.rank.fsdp1 import fsdp1_taps
from rankscope.collectors.rank.funcol_wrap import FuncolPatch
from rankscope.collectors.rank.loss_roots import BackwardRootPatch
from rankscope.collectors.rank.manual_reduce import GradAllReduceTap
from rankscope.collectors.rank.pipeline_infer import PipelineInferencePatch
from rankscope.collectors.rank.work_wait import WorkWaitPatch

__all__ = ["Patches", "build_patches"]


@dataclass(slots=True)
class Patches:
    """The installed patches, in install order, and the two told of step ends."""

    all: list[Any] = field(default_factory=list)
    funcol: FuncolPatch | None = None
    works: WorkWaitPatch | None = None

    def step_done(self) -> None:
        for p in (self.funcol, self.works):
            if p is not None:
                p.step_done()


def build_patches(
    rc: Any, optimizer: Any, on_skipped: Callable[[], None], steps_seen: Callable[[], int]
) -> Patches:
    """The patches of collector ``rc`` (not installed yet), built on the training thread."""
    st, faults, shape, timing = rc.state, rc._faults, rc._shape, rc._timing
    me = threading.get_ident()
    out = Patches()
    if optimizer is not None:
        out.all.append(ScalerPatch(
            optimizer, me,
            on_scale=lambda scale: setattr(st, "loss_scale", scale),
            on_skipped=on_skipped, steps_seen=steps_seen, faults=faults,
        ))  # fmt: skip
    groups = {id(g): name for name, g in rc.identity.groups.items()}
    label = lambda g: group_label(g, groups)  # noqa: E731
    taps = {}
    if shape is not None and shape.fsdp is not None:
        taps = fsdp_taps(shape.fsdp, st, faults, rc._self_time)
    elif shape is not None and shape.fsdp1 is not None:
        taps = fsdp1_taps(shape.fsdp1, st, faults, rc._self_time)
    elif shape is not None and not (shape.ddp or shape.dtensor):  # the loop reduces, if anyone
        taps = {"all_reduce": GradAllReduceTap(st, rc._params, faults, rc._self_time)}
    out.works = WorkWaitPatch(st, me, faults, timing)
    ddp = None
    if shape is not None and shape.ddp:  # under torch.compile, the DDP module it wraps
        ddp = (getattr(shape.module, "_orig_mod", shape.module), rc.config.ddp_group_name)
    foreign = None  # DDP kept a hook of the user's own (ddp_hook.install_ddp_hook)
    if ddp is not None and rc._hook_ctx is None:
        import torch.distributed as dist

        foreign = getattr(ddp[0], "process_group", None) or dist.group.WORLD
    dist_patch = DistPatch(st, label, me, taps=taps, faults=faults, works=out.works,
                           timing=timing, ddp=ddp, foreign_hook_group=foreign,
                           self_time=rc._self_time)  # fmt: skip
    out.all += [out.works, dist_patch]
    # DTensor calls functional collectives, and so do loops of plain tensors (a
    # mixture of experts' all_to_all_single_autograd): wrapped whatever the model
    out.funcol = FuncolPatch(st, label, me, faults, timing)
    out.all.append(out.funcol)
    out.all.append(ClipPatch(st, rc._params, me))
    out.all.append(PipelineInferencePatch(st))  # its made-up gradients are not measured
    out.all.append(BackwardRootPatch(st, me, faults))  # the loss, where rc.loss() is not called
    return out

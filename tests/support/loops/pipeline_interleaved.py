"""An interleaved pipeline the way torchtitan builds one: each pp rank holds two of
the four stages (embedding | first block | second block | head; rank p holds stages
p and p + 2), each stage has its own ``PipelineStage`` and FSDP2 replica over
``dp`` (a ``(dp_replicate, dp_shard)`` sub-mesh of shard size 1), the blocks run
under activation checkpointing (``checkpoint_wrapper``), one optimizer per stage
held by a container like torchtitan's ``OptimizersContainer``, and a
``ScheduleInterleaved1F1B`` over ``opts.accum`` micro-batches. The model handed to
the collector is the rank's list of stages (torchtitan's ``model_parts``).

Each stage starts with ``Work(opts.work_s)``, so a rank's known device time is
two stages' worth per micro-batch, and a straggler hook on each of its stages
(``faults.install``) slows the rank by its factor.
"""

from __future__ import annotations

import torch
from support.loops.model import Opts, TinyLM, Work, lm_loss
from support.loops.pipeline_pp import Built, train  # the same loop drives it
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

__all__ = ["Optimizers", "build", "train"]


class _Stage(nn.Module):
    def __init__(self, inner: nn.Module, work_s: float) -> None:
        super().__init__()
        self.work, self.inner = Work(work_s), inner

    def forward(self, x):
        return self.inner(self.work(x))


class Optimizers(torch.optim.Optimizer):
    """One AdamW per model part, stepped together: torchtitan's container shape.
    ``Optimizer.__init__`` over all the parameters gives it the step hooks."""

    def __init__(self, parts: list[nn.Module], lr: float) -> None:
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in parts]
        torch.optim.Optimizer.__init__(self, [p for m in parts for p in m.parameters()], {})

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def build(rank: int, world: int, opts: Opts, pp: int = 2, schedule: str = "interleaved") -> Built:
    """``schedule``: interleaved (1F1B), looped_bfs, zero_bubble (interleaved zero
    bubble) or zbv (V-shaped placement: rank p holds stages p and 2 pp - 1 - p)."""
    torch.manual_seed(0)
    lm = TinyLM(0.0)
    mesh = init_device_mesh("cpu", (pp, world // pp, 1),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard"))  # fmt: skip
    inner = [lm.embed, checkpoint_wrapper(lm.blocks[0]), checkpoint_wrapper(lm.blocks[1]),
             lm.head]  # fmt: skip
    p = mesh["pp"].get_local_rank()
    held = [p, 2 * pp - 1 - p] if schedule == "zbv" else [p, p + pp]
    parts = [_Stage(inner[i], opts.work_s) for i in held]
    stages = []
    for part, index in zip(parts, held, strict=True):
        fully_shard(part, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)
        stages.append(PipelineStage(part, index, 2 * pp, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))  # fmt: skip
    loss_fn = lambda logits, y: lm_loss(logits, y)  # noqa: E731
    kind = {"interleaved": ScheduleInterleaved1F1B, "looped_bfs": ScheduleLoopedBFS,
            "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[schedule]
    sched = kind(stages, n_microbatches=opts.accum, loss_fn=loss_fn)
    dp_rank = mesh["dp_replicate"].get_local_rank()
    return Built(parts, Optimizers(parts, opts.lr), schedule=sched, last=2 * pp - 1 in held,
                 dp_rank=dp_rank, mesh=mesh, topology=mesh, first=0 in held)  # fmt: skip

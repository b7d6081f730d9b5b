"""Pipeline x data parallel the way torchtitan drives ``torch.distributed.pipelining``:
the TinyLM split into two stages (embedding + first block, second block + head),
one ``PipelineStage`` per rank on the ``pp`` group, each stage replicated over
``dp`` with FSDP2 on a ``(dp_replicate, dp_shard)`` sub-mesh of shard size 1
(HSDP with whole replicas: what ``fully_shard`` does for plain data parallel),
and a GPipe or 1F1B schedule over ``opts.accum`` micro-batches. The last stage
computes the loss; the collector is attached to the rank's stage module.

Not DDP: torch 2.15's pipelining drives a DDP stage through reducer internals
that fail with more than one micro-batch (bucket rebuild: "rebuilt parameter
indices size is not same"; with ``static_graph`` the last stage never reduces
and its replicas silently diverge)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from support.loops.model import Opts, TinyLM, Work, batch, lm_loss
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


class First(nn.Module):
    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.work, self.embed, self.block = lm.work, lm.embed, lm.blocks[0]

    def forward(self, idx):
        return self.block(self.work(self.embed(idx)))


class Last(nn.Module):
    def __init__(self, lm: TinyLM, work_s: float) -> None:
        super().__init__()
        self.work, self.block, self.head = Work(work_s), lm.blocks[1], lm.head

    def forward(self, h):
        return self.head(self.block(self.work(h)))


@dataclass(slots=True)
class Built:
    model: Any
    optimizer: Any
    schedule: Any = None
    last: bool = False
    dp_rank: int = 0
    first: bool = False  # holds stage 0 (with ``last``: a V-shaped placement's rank 0)
    mesh: Any = None
    topology: Any = None


def build(rank: int, world: int, opts: Opts, pp: int = 2, schedule: str = "gpipe") -> Built:
    torch.manual_seed(0)
    lm = TinyLM(opts.work_s)
    mesh = init_device_mesh("cpu", (pp, world // pp, 1),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard"))  # fmt: skip
    stage_index = mesh["pp"].get_local_rank()
    last = stage_index == pp - 1
    model = Last(lm, opts.work_s) if last else First(lm)
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)
    stage = PipelineStage(model, stage_index, pp, torch.device("cpu"),
                          group=mesh["pp"].get_group())  # fmt: skip
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    loss_fn = lambda logits, y: lm_loss(logits, y)  # noqa: E731
    sched = kind(stage, n_microbatches=opts.accum, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    dp_rank = mesh["dp_replicate"].get_local_rank()
    return Built(model, opt, schedule=sched, last=last, dp_rank=dp_rank, mesh=mesh, topology=mesh)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    for step in range(opts.steps):
        x, y = batch(b.dp_rank, step, 0, opts)  # the dp replicas see different data
        args = (x,) if b.first or not b.last else ()
        if b.last:
            losses: list = []
            b.schedule.step(*args, target=y, losses=losses)
            rc.loss(torch.stack(losses).mean())
        else:
            b.schedule.step(*args)
        b.optimizer.step()
        b.optimizer.zero_grad(set_to_none=True)

"""torchtitan-style 2-D parallelism: tensor parallel inside each block
(``up`` column-wise, ``down`` row-wise) on the mesh's ``tp`` dimension, then
FSDP2 over ``dp``; one 2-D mesh ``(dp, tp)``. No ``clip_grad_norm_``: torch's
fails on parameters of two meshes (torchtitan ships its own for that)."""

from __future__ import annotations

import torch
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def build(rank: int, world: int, opts: Opts, tp: int = 2) -> Built:
    torch.manual_seed(0)
    model = TinyLM(opts.work_s)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt, mesh=mesh, topology=mesh)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    dp_rank = b.mesh["dp"].get_local_rank()  # tp peers see the same batch
    for step in range(opts.steps):
        x, y = batch(dp_rank, step, 0, opts)
        loss = lm_loss(model(x), y)
        loss.backward()
        rc.loss(loss)
        opt.step()
        opt.zero_grad()

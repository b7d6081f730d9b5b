"""FSDP2 the way the FSDP2 example and torchtitan wrap it: ``fully_shard`` per
block, then the root; HSDP on a 2-D (replicate, shard) mesh. ``opts.hsdp``
gives the replicate size (0: plain FSDP over the world); reshard after forward
is True for FSDP and False for HSDP here, so both settings run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from support.loops.model import Opts, TinyLM, batch, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@dataclass(slots=True)
class Built:
    model: Any
    optimizer: Any
    mesh: Any = None
    topology: Any = None


def build(rank: int, world: int, opts: Opts, hsdp: int = 0) -> Built:
    torch.manual_seed(0)
    model = TinyLM(opts.work_s)
    if hsdp:
        mesh = init_device_mesh(
            "cpu", (hsdp, world // hsdp), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))  # no names, as the FSDP2 example
    reshard = not hsdp
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt, mesh=mesh, topology=mesh if hsdp else None)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    for step in range(opts.steps):
        x, y = batch(rank, step, 0, opts)
        loss = lm_loss(model(x), y)
        loss.backward()
        if opts.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        rc.loss(loss)
        opt.step()
        opt.zero_grad()

"""FSDP2 the way the FSDP2 example and torchtitan wrap it: ``fully_shard`` per
block, then the root; HSDP on a 2-D (replicate, shard) mesh. ``opts.hsdp``
gives the replicate size (0: plain FSDP over the world); reshard after forward
is True for FSDP and False for HSDP here, so both settings run. ``reduce_dtype``
sets ``MixedPrecisionPolicy(reduce_dtype=...)``: float16 makes FSDP pre-divide
the reduce-scatter input."""

from __future__ import annotations

import torch
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def build(rank: int, world: int, opts: Opts, hsdp: int = 0, reduce_dtype=None) -> Built:
    torch.manual_seed(0)
    model = TinyLM(opts.work_s)
    if hsdp:
        mesh = init_device_mesh(
            "cpu", (hsdp, world // hsdp), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))  # no names, as the FSDP2 example
    kw = {"reshard_after_forward": not hsdp}
    if reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt, mesh=mesh, topology=mesh if hsdp else None)


def train(b: Built, rc, rank: int, opts: Opts, clip=None) -> None:
    """``clip(model, max_norm)``: how the loop clips (default torch's function)."""
    model, opt = b.model, b.optimizer
    for step in range(opts.steps):
        x, y = batch(rank, step, 0, opts)
        loss = lm_loss(model(x), y)
        loss.backward()
        if opts.clip and clip is not None:
            clip(model, opts.clip)
        elif opts.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        rc.loss(loss)
        opt.step()
        opt.zero_grad()

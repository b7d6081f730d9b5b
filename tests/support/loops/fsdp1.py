"""FSDP1, the ``FullyShardedDataParallel`` wrapper that Lightning's ``FSDPStrategy``,
Accelerate and the HF ``Trainer`` still build: one flat parameter per wrapped
block (an auto-wrap policy), full sharding, the wrapped module's own
``clip_grad_norm_``. Its reduce-scatter runs inside autograd hooks the collector
cannot reach, so the local gradient norm is not collected (said once at
attach); the timings, collectives, loss and tokens still are."""

from __future__ import annotations

import torch
from support.loops.model import Block, Built, Opts, TinyLM, batch, lm_loss
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build(rank: int, world: int, opts: Opts, strategy: str = "FULL_SHARD") -> Built:
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        TinyLM(opts.work_s),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    for step in range(opts.steps):
        x, y = batch(rank, step, 0, opts)
        loss = lm_loss(model(x), y)
        loss.backward()
        if opts.clip:
            model.clip_grad_norm_(opts.clip)
        rc.loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

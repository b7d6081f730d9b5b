"""FSDP1, the ``FullyShardedDataParallel`` wrapper that Lightning's ``FSDPStrategy``,
Accelerate and the HF ``Trainer`` still build: one flat parameter per wrapped
block (an auto-wrap policy), full sharding, the wrapped module's own
``clip_grad_norm_``. Its reduce-scatter runs inside autograd hooks the collector
cannot reach, so the local gradient norm is not collected (said once at
attach); the timings, collectives, loss and tokens still are."""

from __future__ import annotations

import torch
from support.loops import fsdp2
from support.loops.model import Block, Built, Opts, TinyLM
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
    """FSDP2's loop, clipped by the wrapper's own ``clip_grad_norm_`` (torch's function
    would take the norm of this rank's shards only)."""
    fsdp2.train(b, rc, rank, opts, clip=lambda model, max_norm: model.clip_grad_norm_(max_norm))

"""nanoGPT-style DDP: gradient accumulation with ``no_sync`` on all but the last
micro-step (nanoGPT sets ``require_backward_grad_sync`` itself; both are the
same switch; ``Opts.no_sync=False``: the naive loop that reduces every micro-step),
loss scaled by the accumulation, ``clip_grad_norm_``, AdamW.
``compile`` names a ``torch.compile`` backend: as nanoGPT does, the model is
compiled first and the compiled module wrapped in DDP."""

from __future__ import annotations

import contextlib

import torch
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss
from torch.nn.parallel import DistributedDataParallel as DDP


def build(rank: int, world: int, opts: Opts, compile: str | None = None, zero: bool = False,
          **ddp_kw) -> Built:  # fmt: skip
    torch.manual_seed(0)
    lm = TinyLM(opts.work_s)
    model = DDP(torch.compile(lm, backend=compile) if compile else lm, **ddp_kw)
    if zero:  # ZeRO-1: each rank steps its slice of the optimizer state, then broadcasts
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=opts.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    for step in range(opts.steps):
        for micro in range(opts.accum):
            last = micro == opts.accum - 1 or not opts.no_sync
            if micro % 2:  # both ways nanoGPT-like loops skip the sync
                model.require_backward_grad_sync = last
                ctx = contextlib.nullcontext()
            else:
                model.require_backward_grad_sync = True
                ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                x, y = batch(rank, step, micro, opts)
                loss = lm_loss(model(x), y) / opts.accum
                loss.backward()
        if opts.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        rc.loss(loss * opts.accum)
        opt.step()
        opt.zero_grad(set_to_none=True)

"""The AMP recipe: autocast forward, ``GradScaler`` scaling the loss, ``unscale_``
before clipping, ``scaler.step`` / ``scaler.update``, under DDP. On CPU autocast
runs in bfloat16; the scaler works the same (it skips a step whose unscaled
gradients hold inf/NaN and halves its scale)."""

from __future__ import annotations

import torch
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss
from torch.nn.parallel import DistributedDataParallel as DDP

INIT_SCALE = 2.0**12


def build(rank: int, world: int, opts: Opts) -> Built:
    torch.manual_seed(0)
    model = DDP(TinyLM(opts.work_s))
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return Built(model, opt, scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt, scaler = b.model, b.optimizer, b.scaler
    for step in range(opts.steps):
        x, y = batch(rank, step, 0, opts)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip or 1.0)
        rc.loss(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

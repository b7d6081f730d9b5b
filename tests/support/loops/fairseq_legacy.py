"""fairseq's legacy distributed loop (before it moved to torch DDP): the plain module,
and after ``backward()`` ``all_reduce_and_rescale_tensors``: the gradients, in
parameter order, copied into one preallocated buffer; each time the next one would
not fit, the filled part is divided by the world size, all-reduced and copied back.
A gradient larger than the buffer is all-reduced on its own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss

BUFFER_ELEMENTS = 3000  # a few buckets for the tiny LM; its embedding goes alone


def build(rank: int, world: int, opts: Opts) -> Built:
    torch.manual_seed(0)  # same initial weights everywhere: replicas
    model = TinyLM(opts.work_s)
    model.reduce_buffer = torch.zeros(BUFFER_ELEMENTS)
    return Built(model, torch.optim.AdamW(model.parameters(), lr=opts.lr))


def all_reduce_and_rescale(grads: list[torch.Tensor], denom: float, buf: torch.Tensor) -> None:
    def flush(bucket: list[torch.Tensor]) -> None:
        n = 0
        for g in bucket:
            buf[n : n + g.numel()].copy_(g.view(-1))
            n += g.numel()
        part = buf[:n]
        part.div_(denom)
        dist.all_reduce(part)
        n = 0
        for g in bucket:
            g.view(-1).copy_(buf[n : n + g.numel()])
            n += g.numel()

    bucket: list[torch.Tensor] = []
    filled = 0
    for g in grads:
        if g.numel() > buf.numel():  # too big for the buffer: reduced in place
            g.div_(denom)
            dist.all_reduce(g)
            continue
        if filled + g.numel() > buf.numel():
            flush(bucket)
            bucket, filled = [], 0
        bucket.append(g)
        filled += g.numel()
    if bucket:
        flush(bucket)


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    world = float(dist.get_world_size())
    for step in range(opts.steps):
        opt.zero_grad()
        for micro in range(opts.accum):
            x, y = batch(rank, step, micro, opts)
            loss = lm_loss(model(x), y) / opts.accum
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_and_rescale(grads, world, model.reduce_buffer)
        if opts.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        opt.step()
        rc.loss(loss * opts.accum)

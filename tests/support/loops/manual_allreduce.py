"""A loop that averages its gradients itself, as PyTorch's "Writing Distributed
Applications" tutorial does: the plain module (no DDP), ``backward()``, then one
``dist.all_reduce`` per parameter's ``.grad`` (``SUM``, divided by the world size),
clipping, the optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss


def build(rank: int, world: int, opts: Opts) -> Built:
    torch.manual_seed(0)  # same initial weights everywhere: replicas
    model = TinyLM(opts.work_s)
    return Built(model, torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9))


def average_gradients(model: torch.nn.Module) -> None:
    size = float(dist.get_world_size())
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
            param.grad.data /= size


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    for step in range(opts.steps):
        opt.zero_grad()
        x, y = batch(rank, step, 0, opts)
        loss = lm_loss(model(x), y)
        loss.backward()
        average_gradients(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip or 1.0)
        opt.step()
        rc.loss(loss.detach())

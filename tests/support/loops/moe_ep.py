"""A Switch-style mixture of experts with expert parallelism over the world.

Each rank holds one expert of the layer; top-1 routing sends every token to
its expert's rank and back, the counts exchanged first. ``functional=False``
moves them with ``torch.distributed.all_to_all_single`` of uneven splits inside
an autograd function whose backward sends the gradients back (gloo's list
``all_to_all`` takes equal sizes only). ``functional=True`` uses
``all_to_all_single_autograd`` as torchtitan does. The dense weights are DDP
replicas; DDP is told to ignore the experts, which differ from rank to rank.
The faults' target, the largest parameter, is a dense one (the embedding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from support.loops.model import DIM, VOCAB, Built, Opts, Work, batch, lm_loss
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class _Exchange(torch.autograd.Function):
    """Rows to ranks by ``send`` counts, ``recv`` counts back; backward the reverse."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int]):
        ctx.counts = (send, recv)
        out = x.new_empty((sum(recv), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.counts
        out = grad.new_empty((sum(send), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv)
        return out, None, None


def _move(x: torch.Tensor, send: list[int], recv: list[int], functional: bool) -> torch.Tensor:
    if not functional:
        return _Exchange.apply(x, send, recv)
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous(), recv, send, dist.group.WORLD)
    return out + 0  # waited for at first use


class SwitchMoE(nn.Module):
    def __init__(self, rank: int, world: int, functional: bool, hidden: int = 16) -> None:
        super().__init__()
        self.world, self.functional = world, functional
        self.router = nn.Linear(DIM, world)
        gen = torch.Generator().manual_seed(100 + rank)  # this rank's own expert
        self.w_in = nn.Parameter(torch.randn(DIM, hidden, generator=gen) * DIM**-0.5)
        self.w_out = nn.Parameter(torch.randn(hidden, DIM, generator=gen) * hidden**-0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tok = h.reshape(-1, DIM)
        prob = torch.softmax(self.router(tok), -1)
        gate, dest = prob.max(-1)
        order = dest.argsort(stable=True)
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        got = _move(tok[order], send.tolist(), recv.tolist(), self.functional)
        done = torch.relu(got @ self.w_in) @ self.w_out
        back = _move(done, recv.tolist(), send.tolist(), self.functional)
        out = torch.empty_like(back).index_copy(0, order, back)
        return h + (out * gate.unsqueeze(-1)).view_as(h)


class MoELM(nn.Module):
    def __init__(self, rank: int, world: int, work_s: float, functional: bool) -> None:
        super().__init__()
        self.work = Work(work_s)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = SwitchMoE(rank, world, functional)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        return self.head(self.moe(self.work(self.embed(idx))))


def build(rank: int, world: int, opts: Opts, functional: bool = False) -> Built:
    torch.manual_seed(0)
    lm = MoELM(rank, world, opts.work_s, functional)
    DDP._set_params_and_buffers_to_ignore_for_model(lm, ["moe.w_in", "moe.w_out"])
    model = DDP(lm)
    return Built(model, torch.optim.AdamW(model.parameters(), lr=opts.lr))


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    for step in range(opts.steps):
        x, y = batch(rank, step, 0, opts)
        loss = lm_loss(b.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(b.model.parameters(), opts.clip or 1.0)
        b.optimizer.step()
        b.optimizer.zero_grad(set_to_none=True)
        rc.loss(loss.detach())


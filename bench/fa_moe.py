"""A mixture-of-experts loop with expert parallelism, as MoE training code writes it.

``moe``: a small GPT whose feed-forward layers are mixtures of 8 experts,
top-2 routing with a load-balancing loss. The experts are spread over the
ranks (2 each on 4 ranks, expert parallelism over the whole world): each
layer sends every token to the ranks that hold its experts and back with two
all-to-alls of uneven sizes (the counts are exchanged first), inside an
autograd function that all-to-alls the gradients back in its backward, the
way DeepSpeed-MoE and Megatron write it. Odd seeds use the functional
``all_to_all_single_autograd`` instead, as torchtitan does. The dense
weights are replicated under DDP, which is told to leave the experts alone
(``_set_params_and_buffers_to_ignore_for_model``): no rank holds another's
experts, so there is nothing to reduce them with.

Two things set it apart from a dense loop: the ranks do NOT hold the same
parameters (only the dense ones are replicas), and a rank's compute depends
on how many tokens the router sent its experts this step, which moves from
step to step and can favour one rank's experts for a while (``moe_skew``).
Neither is a fault.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["LOOPS"]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; its backward sends the
    gradients back the way the tokens came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              functional: bool) -> torch.Tensor:  # fmt: skip
    if functional:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        out = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits,
                                         dist.group.WORLD)  # fmt: skip
        return out * 1  # first use: the functional result is waited for here
    return _AllToAll.apply(x, out_splits, in_splits)


class MoELayer(nn.Module):
    """Top-k routing over ``experts`` experts, ``experts // world`` of them local."""

    def __init__(self, d: int, experts: int, world: int, rank: int, top_k: int = 2,
                 functional: bool = False, favour: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.router = nn.Linear(d, experts, bias=bool(favour))
        if favour:  # a router that leans to rank 0's experts
            with torch.no_grad():
                self.router.bias.zero_()
                self.router.bias[: experts // world] = favour
        self.local, self.world, self.rank = experts // world, world, rank
        self.experts, self.top_k, self.functional = experts, top_k, functional
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank's own experts
        h = 2 * d
        self.w1 = nn.Parameter(torch.randn(self.local, d, h, generator=gen) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(self.local, h, d, generator=gen) / math.sqrt(h))
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tok = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tok), dim=-1)
        gate, expert = probs.topk(self.top_k, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        # Switch-style balance loss: fraction routed times mean probability, per expert
        frac = F.one_hot(expert[:, 0], self.experts).float().mean(0)
        self.aux = self.experts * (frac * probs.mean(0)).sum()
        flat = expert.reshape(-1)
        order = flat.argsort(stable=True)
        src = tok.repeat_interleave(self.top_k, dim=0)[order]
        per_expert = torch.bincount(flat, minlength=self.experts)
        send = per_expert.view(self.world, self.local).sum(1)
        recv_e = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_e, per_expert)  # how many of each local expert's tokens
        recv_e = recv_e.view(self.world, self.local)
        in_splits, out_splits = send.tolist(), recv_e.sum(1).tolist()
        got = _exchange(src, out_splits, in_splits, self.functional)
        # received rows come grouped by sender, each sender's sorted by expert
        local_ids = torch.arange(self.local).repeat(self.world).repeat_interleave(
            recv_e.reshape(-1))  # fmt: skip
        out = torch.empty_like(got)
        for e in range(self.local):  # an expert sent no tokens still joins the graph, so
            sel = local_ids == e  # every rank's backward runs the same all-to-alls
            out[sel] = F.gelu(got[sel] @ self.w1[e]) @ self.w2[e]
        back = _exchange(out, in_splits, out_splits, self.functional)
        y = torch.empty_like(back)
        y[order] = back
        y = (y.view(-1, self.top_k, shape[-1]) * gate.unsqueeze(-1)).sum(1)
        return y.view(shape)


class _Block(nn.Module):
    def __init__(self, d: int, moe: MoELayer) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.moe = moe

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class TinyMoEGPT(nn.Module):
    def __init__(self, rank: int, world: int, functional: bool, vocab: int = 1024,
                 block: int = 32, d: int = 64, layers: int = 2, experts: int = 8,
                 favour: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(
            _Block(d, MoELayer(d, experts, world, rank, functional=functional, favour=favour))
            for _ in range(layers))  # fmt: skip
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mask = self.mask[: idx.shape[1], : idx.shape[1]]
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            h = block(h, mask)
        aux = sum(block.moe.aux for block in self.blocks)  # the balance loss
        logits = self.head(self.ln_f(h)).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten()) + 0.01 * aux

    def expert_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters() if ".moe.w" in n]


class MoELoop:
    """DDP on the dense weights, the experts local; one optimizer step per ``step()``."""

    style = "moe"
    ddp = True
    topology = None
    faults = ("straggler", "sdc-param", "nonfinite", "network")
    favour = 0.0

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        torch.manual_seed(seed)  # the dense weights alike on every rank
        self.model = TinyMoEGPT(rank, world, functional=seed % 2 == 1, favour=self.favour)
        self.steps, self.block, self.batch = steps, 32, 8
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)
        self.data = torch.randint(0, 1024, (20_000,), generator=self.gen)

    def wrap(self) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(self.model, self.model.expert_names())
        self.ddp = DDP(self.model)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3, weight_decay=0.1)
        return self.ddp

    def attributable(self, kind: str, rank: int) -> list[int]:
        return [rank]

    def step(self, it: int, rc) -> None:
        ix = torch.randint(len(self.data) - self.block - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[i : i + self.block] for i in ix])
        y = torch.stack([self.data[i + 1 : i + 1 + self.block] for i in ix])
        loss = self.ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        rc.loss(loss.detach())


class SkewedMoELoop(MoELoop):
    """``moe`` whose router starts out leaning to rank 0's experts (a bias of 1.5 on
    their logits, as a router that collapsed early in training does): rank 0 computes
    for most of the tokens, 1.2-1.3x its peers, until the balance loss evens it out
    (60-80 steps). Busy, not slow."""

    style = "moe_skew"
    favour = 1.5


LOOPS = {"moe": MoELoop, "moe_skew": SkewedMoELoop}

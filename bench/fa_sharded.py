"""torchtitan-like loops for the false-alarm bench: FSDP2, DTensor tensor parallel, FSDP1.

The model is a small Llama the way torchtitan writes it (RMSNorm, attention
with separate ``wq/wk/wv/wo`` whose heads are viewed with ``-1`` so a tensor-
parallel shard holds whole heads, SwiGLU ``w1/w2/w3``, untied output).

``fsdp2``: ``fully_shard`` per block, then the root, on a 1-D mesh of the
world; AdamW with warmup and cosine decay (``LambdaLR``), ``clip_grad_norm_``.
``tp``: a ``(dp, tp)`` mesh with tp = 2: ``wq/wk/wv``, ``w1/w3`` column-wise and
``wo``, ``w2`` row-wise inside each block (torchtitan's plan without sequence
parallel), then FSDP2 over ``dp``; tp partners train on the same batch. No
clipping: torch's ``clip_grad_norm_`` refuses parameters on two meshes.
``fsdp1``: the same model under the ``FullyShardedDataParallel`` wrapper, the
way Lightning's ``FSDPStrategy`` and Accelerate build it.

Pure CPU work, as the DDP loops: no emulated device time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LOOPS"]

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 256, 128, 4, 384, 2, 64, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel this rank holds DIM / tp of the columns
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _warmup_cosine(steps: int, warmup: int = 4):
    def factor(it: int) -> float:
        if it < warmup:
            return (it + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (it - warmup) / max(1, steps - warmup)))

    return factor


class _TitanLoop:
    """What both styles share: data per data-parallel rank, the step, the schedule."""

    ddp = False
    clip = True
    reduce_op = "reduce_scatter_single"  # FSDP2's gradient reduction (the slow-link fault's)

    def attributable(self, kind: str, rank: int) -> list[int]:
        """Every fault is the rank's own. Under tp the poisoned logit makes this rank's
        loss non-finite while its partner's stays finite (the output layer runs after
        the last forward all-reduce), and the partner's gradients go non-finite only in
        backward: the origin is still the rank."""
        return [rank]

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        torch.manual_seed(seed)  # same initial weights everywhere: fully_shard keeps shards
        self.model = TinyLlama()
        self.rank, self.world, self.seed, self.steps = rank, world, seed, steps
        self.topology = None

    def _finish(self, dp_rank: int) -> nn.Module:
        self.gen = torch.Generator().manual_seed(self.seed * 1000 + dp_rank)
        self.data = torch.randint(0, VOCAB, (20_000,), generator=self.gen)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1,
                                     betas=(0.9, 0.95))  # fmt: skip
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _warmup_cosine(self.steps))
        return self.model

    def step(self, it: int, rc) -> None:
        ix = torch.randint(len(self.data) - SEQ - 1, (BATCH,), generator=self.gen)
        x = torch.stack([self.data[i : i + SEQ] for i in ix])
        y = torch.stack([self.data[i + 1 : i + 1 + SEQ] for i in ix])
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if self.clip:
            self._clip(1.0)
        self.opt.step()
        self.sched.step()
        rc.loss(loss.detach())
        self.opt.zero_grad()

    def _clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class FSDP2Loop(_TitanLoop):
    """torchtitan's data-parallel shard: ``fully_shard`` per block, then the root."""

    style = "fsdp2"
    # nothing is replicated (every rank holds a different shard): a flipped weight
    # has no replica to disagree with, so sdc-param is not attributable here
    faults = ("straggler", "network", "nonfinite")

    def wrap(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.world,))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        return self._finish(self.rank)


class TPLoop(_TitanLoop):
    """torchtitan's 2-D parallelism: tensor parallel 2 inside the blocks, FSDP2 over dp."""

    style = "tp"
    tp = 2
    clip = False
    faults = ("straggler", "network", "nonfinite")

    def wrap(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if self.world % self.tp:
            raise ValueError(f"tp style: world {self.world} is not a multiple of tp {self.tp}")
        mesh = init_device_mesh("cpu", (self.world // self.tp, self.tp),
                                mesh_dim_names=("dp", "tp"))  # fmt: skip
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }  # fmt: skip
        for layer in self.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(self.model, mesh=mesh["dp"])
        self.topology = mesh
        return self._finish(mesh["dp"].get_local_rank())


class FSDP1Loop(_TitanLoop):
    """The ``FullyShardedDataParallel`` wrapper as Lightning's ``FSDPStrategy`` and
    Accelerate build it: one unit per block (an auto-wrap policy), full sharding,
    ``use_orig_params``, clipping by the wrapper's own ``clip_grad_norm_``."""

    style = "fsdp1"
    faults = ("straggler", "network", "nonfinite")

    def wrap(self) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        self.model = FullyShardedDataParallel(
            self.model, auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
            use_orig_params=True,
        )  # fmt: skip
        return self._finish(self.rank)

    def _clip(self, max_norm: float) -> None:
        self.model.clip_grad_norm_(max_norm)


LOOPS = {"fsdp2": FSDP2Loop, "tp": TPLoop, "fsdp1": FSDP1Loop}

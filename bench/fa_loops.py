"""DDP training loops written the way people write them, NOT rankscope's own harness.

``nanogpt``: a small GPT (token + position embeddings, pre-norm blocks, tied
head), AdamW with warmup and cosine decay, gradient accumulation with
``no_sync`` on the micro-steps, ``clip_grad_norm_`` before the step.
``tutorial``: the PyTorch DDP tutorial's shape: an MLP on a ``TensorDataset``
behind a ``DistributedSampler`` and a ``DataLoader``, SGD, MSE loss, epochs.
``amp``: the AMP recipe on the nanoGPT model: ``autocast`` (float16 on even
seeds, bfloat16 on odd ones), ``GradScaler``, ``unscale_`` before clipping.
The FSDP2 and tensor-parallel loops are in ``fa_sharded.py``, the pipelined one in
``fa_pipeline.py``, the Trainer-shaped one with variable-length batches in
``fa_varlen.py``, the mixture of experts in ``fa_moe.py``, the one that averages
its gradients itself (no DDP) in ``fa_manual.py``, Megatron-LM's gradient buffer
around the nanoGPT step in ``fa_megatron.py``.

Every loop has ``wrap()`` (the module the collector attaches to; the
optimizer is built after it), ``step(it, rc)``, ``faults`` (the fault kinds
that can be localized under this wrapping) and ``attributable(kind, rank)``
(the ranks a fault on ``rank`` is to be blamed on).

Both are pure CPU work (no emulated device time): on a 2-core host shared by 4
ranks the timings carry real scheduling noise, which is the point.
"""

from __future__ import annotations

import inspect
import io
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from fa_manual import LOOPS as MANUAL
from fa_megatron import megatron_loop
from fa_moe import LOOPS as MOE
from fa_pipeline import LOOPS as PIPELINE
from fa_sharded import LOOPS as SHARDED
from fa_varlen import LOOPS as VARLEN
from torch import nn

__all__ = ["LOOPS", "build_loop"]


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, block: int = 32, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(_Block(d, 4) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as nanoGPT does
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1))
        for m in self.modules():  # nanoGPT's init: small normal weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class _DDPLoop:
    """DDP over the whole world: every rank a replica, so every fault kind is its own."""

    ddp = True
    topology = None
    faults = ("straggler", "sdc-param", "nonfinite", "network")

    def wrap(self) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(self.model)
        self.make_optimizer(ddp)
        return ddp

    def attributable(self, kind: str, rank: int) -> list[int]:
        return [rank]


class NanoGPTLoop(_DDPLoop):
    """nanoGPT's train.py shape; ``step()`` runs one optimizer step (all micro-steps)."""

    style = "nanogpt"

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        torch.manual_seed(seed)  # same initial weights on every rank
        self.model = TinyGPT()
        self.block, self.batch, self.accum = 32, 8, 2
        self.steps = steps
        gen = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own data
        self.data = torch.randint(0, 256, (20_000,), generator=gen)
        self.gen = gen

    def make_optimizer(self, ddp: nn.Module) -> torch.optim.Optimizer:
        self.ddp = ddp
        self.opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1,
                                     betas=(0.9, 0.95))  # fmt: skip
        return self.opt

    def _lr(self, it: int) -> float:
        warm = 5
        if it < warm:
            return 1e-3 * (it + 1) / warm
        ratio = (it - warm) / max(1, self.steps - warm)
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.data) - self.block - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[i : i + self.block] for i in ix])
        y = torch.stack([self.data[i + 1 : i + 1 + self.block] for i in ix])
        return x, y

    def _autocast(self):
        return nullcontext()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()

    def step(self, it: int, rc) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self._lr(it)
        for micro in range(self.accum):
            x, y = self._batch()
            sync = micro == self.accum - 1
            with nullcontext() if sync else self.ddp.no_sync():
                with self._autocast():
                    loss = self.ddp(x, y) / self.accum
                self._backward(loss)
        self._update()
        self.last_loss = loss.detach()
        rc.loss(loss.detach().float() * self.accum)
        self.opt.zero_grad(set_to_none=True)


class TutorialLoop(_DDPLoop):
    """The DDP tutorial's shape: sampler, loader, SGD, MSE; ``step()`` is one batch."""

    style = "tutorial"

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512),
                                   nn.ReLU(), nn.Linear(512, 8))  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        xs = torch.randn(4096, 64, generator=gen)
        ys = torch.randn(4096, 8, generator=gen)
        ds = TensorDataset(xs, ys)
        self.sampler = DistributedSampler(ds, shuffle=True, seed=seed)
        self.loader = DataLoader(ds, batch_size=64, sampler=self.sampler)
        self.epoch = 0
        self.it = iter(())

    def make_optimizer(self, ddp: nn.Module) -> torch.optim.Optimizer:
        self.ddp = ddp
        self.opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        return self.opt

    def step(self, it: int, rc) -> None:
        try:
            x, y = next(self.it)
        except StopIteration:
            self.sampler.set_epoch(self.epoch)
            self.epoch += 1
            self.it = iter(self.loader)
            x, y = next(self.it)
        self.opt.zero_grad()
        loss = F.mse_loss(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        rc.loss(loss.detach())


class AMPLoop(NanoGPTLoop):
    """The AMP recipe around nanoGPT's step: autocast forward, scaled backward,
    ``unscale_`` then clip, ``scaler.step`` / ``scaler.update``."""

    style = "amp"
    # a NaN gradient under AMP is the scaler's business: it skips the step on every
    # rank and lowers the scale (by design, not a fault), so nonfinite is left out
    faults = ("straggler", "sdc-param", "network")

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        super().__init__(rank, world, seed, steps)
        self.dtype = torch.float16 if seed % 2 == 0 else torch.bfloat16
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)

    def _autocast(self):
        return torch.autocast("cpu", dtype=self.dtype)

    def _backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def _update(self) -> None:
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()


class NanoGPTMasterLoop(NanoGPTLoop):
    """nanoGPT's train.py around the step: every ``eval_interval`` steps the master
    alone runs ``estimate_loss`` (``eval_iters`` no-grad forwards through the DDP
    module, in eval mode) and saves a checkpoint, while the others go on into the
    next step's all-reduce and wait; every ``log_interval`` it reads ``loss.item()``.
    A rank that always does more between steps is the job's doing, not a fault."""

    style = "nanogpt_master"
    eval_interval, eval_iters, log_interval = 8, 6, 2

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        super().__init__(rank, world, seed, steps)
        self.master = rank == 0
        self.ckpt, self.log = None, []

    def wrap(self) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # nanoGPT's model has no buffers (flash attention), so its DDP forward syncs
        # none; this one's causal mask would be broadcast by the master alone in eval
        new = "forward_sync_buffers" in inspect.signature(DDP).parameters
        ddp = DDP(self.model, **{"forward_sync_buffers" if new else "broadcast_buffers": False})
        self.make_optimizer(ddp)
        return ddp

    @torch.no_grad()
    def _estimate_loss(self) -> float:
        self.ddp.eval()
        losses = [float(self.ddp(*self._batch())) for _ in range(self.eval_iters)]
        self.ddp.train()
        return sum(losses) / len(losses)

    def step(self, it: int, rc) -> None:
        if it % self.eval_interval == 0 and self.master:
            self._estimate_loss()
            buf = io.BytesIO()  # torch.save of model and optimizer, as train.py does
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                        "iter_num": it}, buf)  # fmt: skip
            self.ckpt = buf.getvalue()
        super().step(it, rc)
        if it % self.log_interval == 0 and self.master:
            self.log.append(f"iter {it}: loss {self.last_loss.item() * self.accum:.4f}")


LOOPS = {"nanogpt": NanoGPTLoop, "nanogpt_master": NanoGPTMasterLoop, "tutorial": TutorialLoop,
         **SHARDED, "amp": AMPLoop, **PIPELINE, **VARLEN, **MOE, **MANUAL,
         "megatron": megatron_loop(NanoGPTLoop)}  # fmt: skip


def build_loop(style: str, rank: int, world: int, seed: int, steps: int):
    """A fresh loop of ``style`` (its model built with ``seed``, same on every rank)."""
    if style not in LOOPS:
        raise ValueError(f"unknown loop style {style!r} (known: {', '.join(LOOPS)})")
    return LOOPS[style](rank, world, seed, steps)

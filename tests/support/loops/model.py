"""A tiny language model whose compute time is known: real layers plus a fixed sleep.

On a shared 2-core host real FLOPs of a tiny model vary more from step to step
than the slowdowns under test; the ``Work`` layer adds a fixed "device time"
(like ``pipeline/simulate``'s device clock) so a 1.5x straggler is 1.5x.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 64, 32, 64, 16


class Work(nn.Module):
    """Identity that takes ``work_s`` (per forward, as a slower device would)."""

    def __init__(self, work_s: float) -> None:
        super().__init__()
        self.work_s = work_s

    def forward(self, x):
        if self.work_s:
            time.sleep(self.work_s)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding, two MLP blocks, a head: the shapes nanoGPT-like loops feed."""

    def __init__(self, work_s: float = 0.0) -> None:
        super().__init__()
        self.work = Work(work_s)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.work(self.embed(idx))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@dataclass(slots=True, kw_only=True)
class Opts:
    steps: int = 24
    batch: int = 4
    accum: int = 1  # micro-batches per optimizer step
    no_sync: bool = True  # False: accumulation reduces every micro-step (no no_sync)
    clip: float | None = 1.0
    work_s: float = 0.02
    lr: float = 0.01
    report_loss: bool = True  # False: the loop's rc.loss() calls do nothing (harness)


def batch(rank: int, step: int, micro: int, opts: Opts) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + micro)
    x = torch.randint(0, VOCAB, (opts.batch, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


@dataclass(slots=True)
class Built:
    """What a loop style's ``build`` hands the harness: the module to attach to, its
    optimizer, the mesh and what to pass as ``topology=`` (None: the default)."""

    model: Any
    optimizer: Any
    mesh: Any = None
    topology: Any = None
    scaler: Any = None  # AMP's GradScaler

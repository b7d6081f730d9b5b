"""Megatron-LM's data parallel on the tests' tiny LM: ``main_grad`` views of one
fp32 buffer, buckets of it scaled and all-reduced asynchronously from inside
backward, ``.grad`` handed the reduced ``main_grad`` for the optimizer step
(``GradBuffer``: the bench's, ``bench/fa_megatron.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from support.loops.model import Built, Opts, TinyLM, batch, lm_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from fa_megatron import GradBuffer  # noqa: E402


def build(rank: int, world: int, opts: Opts) -> Built:
    torch.manual_seed(0)  # same initial weights everywhere: replicas
    model = TinyLM(opts.work_s)
    model.grad_buffer = GradBuffer(model, bucket_elements=3000)  # a few buckets
    return Built(model, torch.optim.AdamW(model.parameters(), lr=opts.lr))


def train(b: Built, rc, rank: int, opts: Opts) -> None:
    model, opt = b.model, b.optimizer
    buf = model.grad_buffer
    for step in range(opts.steps):
        for micro in range(opts.accum):
            buf.start(sync=micro == opts.accum - 1)
            x, y = batch(rank, step, micro, opts)
            loss = lm_loss(model(x), y) / opts.accum
            loss.backward()
        buf.finish()
        if opts.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        opt.step()
        buf.zero()
        rc.loss(loss * opts.accum)

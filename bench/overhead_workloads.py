"""The training workloads bench_collector_overhead.py measures the collector on.

The collector's own costs scale with the number of PARAMETERS (two gradient
norm passes, one digest read, a few Python hooks per step), while a step's
compute scales with parameters times the samples or tokens of the batch. So
the ratio depends on how much work a step does per parameter byte, and the
benchmark measures two points:

* ``mlp``: a 134k-parameter MLP on 32 samples a step, about 1 ms of compute:
  almost nothing per parameter, the worst case for the collector's fixed
  costs (100 µs is 2-3% of its step);
* ``lm``: a small causal transformer language model (about 0.5M parameters)
  on 8 sequences of 128 tokens a step, clipping its gradients as language
  model loops do: the shape of real training, where a step processes many
  tokens per parameter (and the collector reuses the clipping's norm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Workload", "WORKLOADS"]


@dataclass(frozen=True, slots=True)
class Workload:
    """One model, its per-rank batch and its loss."""

    name: str
    describe: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # rank -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    clip: float | None = None  # the loop clips gradients to this L2 norm (every arm)

    def step(self, model, opt, x, y, rc=None, after_backward=None) -> None:
        """One training step as the benches' loops run it (``rc`` gets the loss;
        ``after_backward(model)``: a loop's own gradient reduction)."""
        opt.zero_grad(set_to_none=True)
        loss = self.loss(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
        if rc is not None:
            rc.loss(loss)
        opt.step()


def _mlp(hidden: int = 256, batch: int = 32) -> Workload:
    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def make_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, hidden, generator=gen)
        return x, torch.randint(0, 10, (batch,), generator=gen)

    return Workload(
        name="mlp",
        describe=f"MLP width {hidden}, batch {batch}",
        make_model=make_model,
        make_batch=make_batch,
        loss=nn.functional.cross_entropy,
    )


class _CausalLM(nn.Module):
    """Token + position embeddings, pre-norm causal encoder blocks, a head."""

    def __init__(self, vocab: int, d_model: int, heads: int, ffn: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, ffn, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos.weight[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(h)


def _lm(
    vocab: int = 256, d_model: int = 128, heads: int = 4, ffn: int = 512, layers: int = 2,
    batch: int = 8, seq: int = 128,
) -> Workload:  # fmt: skip
    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return _CausalLM(vocab, d_model, heads, ffn, layers, seq)

    def make_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    return Workload(
        name="lm",
        describe=f"causal LM d_model {d_model} x {layers} layers, {batch} x {seq} tokens, "
        "gradients clipped to norm 1 as LM loops do",
        make_model=make_model,
        make_batch=make_batch,
        loss=loss,
        clip=1.0,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {"mlp": _mlp, "lm": _lm}

"""The model and data the simulated ranks train: a tiny causal transformer LM.

Small enough that one step is a few milliseconds on one CPU thread, real
enough that the telemetry behaves like training: the loss falls, local
gradient norms differ across ranks (each rank draws its own data from its own
seed) while the reduced ones agree, and step times wobble because every rank
draws a different sequence length every step, so detectors must not over-fire
on ordinary noise.

The task: continue arithmetic sequences ``x_t = (a*t + b) mod V`` with a few
noisy tokens, which a small transformer learns within a hundred steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelConfig", "TinyLM", "BatchSource"]


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    """Sizes of the model and of one rank's batches."""

    vocab: int = 64
    """Token vocabulary size."""
    d_model: int = 32
    """Hidden width."""
    n_heads: int = 2
    """Attention heads per layer."""
    n_layers: int = 2
    """Transformer blocks."""
    ffn: int = 64
    """Feed-forward width."""
    batch: int = 8
    """Sequences per rank per step."""
    min_len: int = 12
    """Shortest sequence length drawn (tokens)."""
    max_len: int = 40
    """Longest sequence length drawn (tokens)."""
    noise: float = 0.05
    """Fraction of tokens replaced by random ones."""
    device_us_per_token: float = 500.0
    """Emulated accelerator time per token in forward (backward: twice); see device.py.

    500 us makes device time ~95% of ``compute_s`` (a 26-token x 8 batch takes
    ~310 ms of device time against ~15 ms of CPU), as on a GPU job, where the
    host's scheduling noise is a small share of a step. Eight ranks on two
    cores add ~6 ms of scheduling noise to every compute time whatever its
    length: at 100 us that was a relative robust sigma of 6-11%, at 300 us
    3-4.5% (depending on the machine's load), at 500 us ~2%.
    """

    def __post_init__(self) -> None:
        if self.vocab < 4 or self.d_model < 4 or self.n_layers < 1 or self.batch < 1:
            raise ValueError("ModelConfig: vocab, d_model >= 4; n_layers, batch >= 1")
        if self.d_model % self.n_heads:
            raise ValueError("ModelConfig: d_model must be a multiple of n_heads")
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError("ModelConfig: need 2 <= min_len <= max_len")
        if not 0.0 <= self.noise < 1.0:
            raise ValueError("ModelConfig: noise should be within [0, 1)")
        if self.device_us_per_token < 0:
            raise ValueError("ModelConfig: device_us_per_token should be >= 0")


class TinyLM(nn.Module):
    """Token + position embeddings, a few pre-norm encoder blocks with a causal mask, a head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        block = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.ffn, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device)
        h = self.tok(tokens) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


class BatchSource:
    """One rank's private data stream: its own generator, its own lengths."""

    def __init__(self, cfg: ModelConfig, seed: int, rank: int):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed * 100_003 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both ``batch x (len-1)`` token ids."""
        cfg, g = self.cfg, self.gen
        n = int(torch.randint(cfg.min_len, cfg.max_len + 1, (1,), generator=g)) + 1
        a = torch.randint(1, 7, (cfg.batch, 1), generator=g)
        b = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
        seq = (a * torch.arange(n) + b) % cfg.vocab
        noisy = torch.rand(seq.shape, generator=g) < cfg.noise
        seq = torch.where(noisy, torch.randint(0, cfg.vocab, seq.shape, generator=g), seq)
        return seq[:, :-1], seq[:, 1:]

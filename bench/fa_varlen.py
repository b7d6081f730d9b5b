"""A Hugging Face Trainer-shaped loop: variable-length batches, ``model(**batch)``.

``varlen``: a small BERT-like sequence classifier fine-tuned the way the
Trainer does it. Sequences of many lengths (log-normal, 4-128 tokens) sit
behind a ``DistributedSampler``; a collator pads each batch to its own
longest sequence (``DataCollatorWithPadding``), so every rank's step does a
different amount of work, up to a few times its peers'. The model is called
with keywords (``input_ids``, ``attention_mask``, ``labels``) and returns a
dict with the loss; DDP is built with ``find_unused_parameters=True`` (the
Trainer's default for its models); AdamW with linear warmup and decay,
``clip_grad_norm_``, ``loss.item()`` every few steps for the log.

A rank that drew a long batch is busy, not slow: this style checks that the
detectors count tokens (read from the keyword ``input_ids``) before they blame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LOOPS"]


class TinyEncoderClassifier(nn.Module):
    """Token and position embeddings, a Transformer encoder that ignores padding,
    the first token pooled through a tanh layer, a linear classifier."""

    def __init__(self, vocab: int = 512, max_len: int = 128, d: int = 64, layers: int = 2,
                 classes: int = 4) -> None:  # fmt: skip
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True,
                                           norm_first=False)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pool, self.head = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t))
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        logits = self.head(torch.tanh(self.pool(x[:, 0])))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, gen: torch.Generator, n: int = 4096, vocab: int = 512) -> None:
        lengths = torch.exp(3.2 + 0.6 * torch.randn(n, generator=gen)).clamp(4, 128).long()
        self.ids = [torch.randint(1, vocab, (int(n_),), generator=gen) for n_ in lengths]
        self.labels = torch.randint(0, 4, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _pad_collate(items: list[dict]) -> dict:
    """Pad to the batch's longest sequence, with the attention mask to match."""
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n], mask[row, :n] = it["input_ids"], 1
    labels = torch.stack([it["labels"] for it in items])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class VarlenLoop:
    """The Trainer's inner loop, one optimizer step per ``step()``."""

    style = "varlen"
    ddp = True
    topology = None
    faults = ("straggler", "sdc-param", "nonfinite", "network")
    warmup, log_every = 5, 4

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        from torch.utils.data import DataLoader, DistributedSampler

        torch.manual_seed(seed)
        self.model = TinyEncoderClassifier()
        ds = _Sequences(torch.Generator().manual_seed(seed))
        self.sampler = DistributedSampler(ds, shuffle=True, seed=seed)
        self.loader = DataLoader(ds, batch_size=8, sampler=self.sampler, collate_fn=_pad_collate)
        self.steps, self.epoch, self.it, self.log = steps, 0, iter(()), []

    def wrap(self) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.ddp = DDP(self.model, find_unused_parameters=True)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=5e-4, weight_decay=0.01)
        warm, total = self.warmup, max(self.steps, self.warmup + 1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / (total - warm)),
        )
        return self.ddp

    def attributable(self, kind: str, rank: int) -> list[int]:
        return [rank]

    def _next(self) -> dict:
        try:
            return next(self.it)
        except StopIteration:
            self.sampler.set_epoch(self.epoch)
            self.epoch += 1
            self.it = iter(self.loader)
            return next(self.it)

    def step(self, it: int, rc) -> None:
        self.ddp.train()
        out = self.ddp(**self._next())
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.ddp.zero_grad(set_to_none=True)
        rc.loss(out["loss"].detach())
        if it % self.log_every == 0:
            self.log.append(f"step {it}: loss {out['loss'].item():.4f}")


LOOPS = {"varlen": VarlenLoop}

"""What the Hugging Face loop tests share: a keyword-called classifier, variable-length
sequences padded per batch, torchrun's environment for a spawned rank, and a weight
bit flip installed from outside the loop."""

from __future__ import annotations

import os
import socket
import struct

import torch

WORLD = 4


class Classifier(torch.nn.Module):
    """Called the Trainer's way: keywords in, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 3)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, True)
        logits = self.head(h)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def sequences(n: int = 512) -> list[dict]:
    """``n`` examples of 3-39 token ids each, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 64, (int(k),), generator=gen),
             "labels": torch.tensor(int(k) % 3)}
            for k in torch.randint(3, 40, (n,), generator=gen)]  # fmt: skip


def collate(items: list[dict]) -> dict:
    """``DataCollatorWithPadding``'s per-batch padding, with the attention mask."""
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n], mask[row, :n] = it["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.stack([it["labels"] for it in items])}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, port: int) -> None:
    """What torchrun sets for a rank, so Accelerate initializes the group itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)


def flip_after(opt: torch.optim.Optimizer, at_step: int, step_of) -> None:
    """After update ``at_step`` (``step_of()``: the step in progress), flip one mantissa
    bit of one weight: a fault registered on the torch optimizer, not in the loop."""
    w = opt.param_groups[0]["params"][0]

    def post(optimizer, args, kwargs):
        if step_of() == at_step:
            with torch.no_grad():
                (word,) = struct.unpack("<I", struct.pack("<f", float(w.view(-1)[5])))
                w.view(-1)[5] = struct.unpack("<f", struct.pack("<I", word ^ (1 << 22)))[0]

    opt.register_step_post_hook(post)


def steps_of(trace) -> dict[int, dict[int, dict]]:
    """step -> rank -> step record."""
    out: dict[int, dict[int, dict]] = {}
    for rec in trace.records:
        if rec["type"] == "step":
            out.setdefault(rec["step"], {})[rec["rank"]] = rec
    return out

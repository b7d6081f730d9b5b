"""A Hugging Face Accelerate loop, unchanged but for the attach, on real gloo ranks.

``accelerator.prepare`` hands back DDP and an ``AcceleratedOptimizer``, a
wrapper built without ``Optimizer.__init__`` (no step hooks of its own) that
steps its torch optimizer only on the last micro-batch of an accumulation.
The collector hooks that inner optimizer: one record per optimizer step,
tokens counted from the keyword ``input_ids`` of both micro-batches (padded per
batch, so they differ across ranks), and a bit flipped in one rank's weights
after one update, from outside the loop, named ``sdc`` on that rank.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import read_trace

pytestmark = pytest.mark.multiproc

WORLD, STEPS, ACCUM = 4, 16, 2
FLIP_RANK, FLIP_STEP = 2, 9


class _Classifier(torch.nn.Module):
    """Called the Trainer's way: keywords in, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 3)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, True)
        return {"loss": torch.nn.functional.cross_entropy(self.head(h), labels)}


def _collate(items):
    longest = max(len(ids) for ids, _ in items)  # DataCollatorWithPadding's per-batch pad
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (seq, _) in enumerate(items):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.stack([label for _, label in items])}  # fmt: skip


def _flip_after(opt, step_of):
    """After update FLIP_STEP, flip one mantissa bit of one weight (a fault, not the loop)."""
    w = opt.param_groups[0]["params"][0]

    def post(optimizer, args, kwargs):
        if step_of() == FLIP_STEP:
            with torch.no_grad():
                (word,) = struct.unpack("<I", struct.pack("<f", float(w.view(-1)[5])))
                w.view(-1)[5] = struct.unpack("<f", struct.pack("<I", word ^ (1 << 22)))[0]

    opt.register_step_post_hook(post)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # what torchrun sets
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from rankscope.collectors import RankCollector

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = _Classifier()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(1, 64, (int(n),), generator=gen), torch.tensor(int(n) % 3))
            for n in torch.randint(3, 40, (512,), generator=gen)]  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, collate_fn=_collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    rc = RankCollector.attach(model, optimizer, job="accelerate", sink=f"file://{out}",
                              host="node00")  # fmt: skip
    if rank == FLIP_RANK:
        _flip_after(optimizer.optimizer, lambda: rc.step_index)
    batches = iter(loader)
    for _ in range(STEPS * ACCUM):
        with accelerator.accumulate(model):
            loss = model(**next(batches))["loss"]
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        rc.loss(loss.detach())
    rc.close()
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_accelerate_loop_with_accumulation_records_optimizer_steps_and_names_the_flip(
    tmp_path: Path,
):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    trace = read_trace(tmp_path)
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    steps: dict[int, dict[int, dict]] = {}
    for rec in trace.records:
        if rec["type"] == "step":
            steps.setdefault(rec["step"], {})[rec["rank"]] = rec
    assert sorted(steps) == list(range(STEPS))  # optimizer steps, not micro-batches
    assert all(sorted(steps[s]) == list(range(WORLD)) for s in steps)
    tokens = [[steps[s][r]["tokens"] for r in range(WORLD)] for s in range(STEPS)]
    assert all(t >= 2 * 4 * 3 for row in tokens for t in row), tokens  # two micro-batches
    assert sum(len(set(row)) > 1 for row in tokens) >= STEPS // 2, tokens
    for s in range(FLIP_STEP):  # replicas agree until the flip
        assert len({steps[s][r]["param_digest"] for r in range(WORLD)}) == 1, s
        assert len({steps[s][r]["grad_norm_reduced"] for r in range(WORLD)}) == 1, s
    assert all(steps[3][r]["comm_s"] > 0 and steps[3][r]["collectives"] for r in range(WORLD))

    found = replay_trace(tmp_path).findings
    sdc = [f for f in found if f.kind == "sdc"]
    assert [(f.ranks, f.first_step) for f in sdc] == [([FLIP_RANK], FLIP_STEP)], found
    assert not [f for f in found if f.action in ("evict", "recover") and f.kind != "sdc"], found

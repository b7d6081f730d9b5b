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

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import read_trace
from support.hf_style import (
    WORLD,
    Classifier,
    collate,
    flip_after,
    free_port,
    sequences,
    steps_of,
    torchrun_env,
)

pytestmark = pytest.mark.multiproc

STEPS, ACCUM = 16, 2
FLIP_RANK, FLIP_STEP = 2, 9


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, port)
    from accelerate import Accelerator
    from rankscope.collectors import RankCollector

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = Classifier()
    loader = torch.utils.data.DataLoader(sequences(), batch_size=4, shuffle=True,
                                         collate_fn=collate)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    rc = RankCollector.attach(model, optimizer, job="accelerate", sink=f"file://{out}",
                              host="node00")  # fmt: skip
    if rank == FLIP_RANK:
        flip_after(optimizer.optimizer, FLIP_STEP, lambda: rc.step_index)
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


def test_an_accelerate_loop_with_accumulation_records_optimizer_steps_and_names_the_flip(
    tmp_path: Path,
):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    trace = read_trace(tmp_path)
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    steps = steps_of(trace)
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

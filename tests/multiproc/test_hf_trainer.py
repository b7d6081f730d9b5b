"""A Hugging Face ``Trainer`` run, unchanged but for ``attach_trainer``, on real gloo ranks.

The Trainer wraps the model in DDP and builds its optimizer inside ``train()``;
the collector's callback attaches to both there. Gradient accumulation 2,
variable-length batches padded per batch, a bit flipped in one rank's weights
after one update by a second callback (outside the loop): one record per
optimizer step, tokens and the loss of both micro-batches, DDP's all-reduce
seen, and the flip named ``sdc`` on its rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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
FLIP_RANK, FLIP_STEP = 1, 7


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, port)
    from rankscope.collectors.integrations.hf_trainer import attach_trainer
    from transformers import Trainer, TrainerCallback, TrainingArguments

    args = TrainingArguments(
        output_dir=str(Path(out) / "hf"), use_cpu=True, ddp_backend="gloo",
        per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=4, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=Classifier(), args=args, train_dataset=sequences(),
                      data_collator=collate)  # fmt: skip
    hooked = attach_trainer(trainer, job="hf-trainer", sink=f"file://{out}/trace",
                            host="node00")  # fmt: skip

    class Flip(TrainerCallback):  # the fault, from outside the loop
        def on_train_begin(self, args, state, control, **kwargs):
            if rank == FLIP_RANK:
                flip_after(trainer.optimizer.optimizer, FLIP_STEP, lambda: hooked.rc.step_index)

    trainer.add_callback(Flip())
    trainer.train()
    assert hooked.rc is not None and not hooked.rc.faults, hooked.rc.faults


def test_a_trainer_run_is_recorded_through_its_callback_and_the_flip_is_named(tmp_path: Path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    trace = read_trace(tmp_path / "trace")
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    steps = steps_of(trace)
    assert sorted(steps) == list(range(STEPS))  # optimizer steps, not micro-batches
    assert all(sorted(steps[s]) == list(range(WORLD)) for s in steps)
    tokens = [[steps[s][r]["tokens"] for r in range(WORLD)] for s in range(STEPS)]
    assert all(t >= 2 * 4 * 3 for row in tokens for t in row), tokens  # two micro-batches
    assert sum(len(set(row)) > 1 for row in tokens) >= STEPS // 2, tokens
    assert all(0 < steps[s][r]["loss"] < 5 for s in steps for r in range(WORLD))
    for s in range(FLIP_STEP):  # replicas agree until the flip
        assert len({steps[s][r]["param_digest"] for r in range(WORLD)}) == 1, s
    colls = steps[3][0]["collectives"]  # DDP's all-reduce, seen on the wrapped model
    assert colls and colls[0]["op"] == "allreduce" and steps[3][0]["comm_s"] > 0

    found = replay_trace(tmp_path / "trace").findings
    sdc = [f for f in found if f.kind == "sdc"]
    assert [(f.ranks, f.first_step) for f in sdc] == [([FLIP_RANK], FLIP_STEP)], found
    assert not [f for f in found if f.action in ("evict", "recover") and f.kind != "sdc"], found

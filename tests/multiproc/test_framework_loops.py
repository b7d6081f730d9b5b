"""Loops that frameworks own (Accelerate, the Hugging Face Trainer, Lightning), unchanged
but for the attach, on real gloo ranks.

Accelerate: ``accelerator.prepare`` hands back DDP and an ``AcceleratedOptimizer``,
a wrapper built without ``Optimizer.__init__`` (no step hooks of its own) that
steps its torch optimizer only on the last micro-batch of an accumulation; the
collector hooks that inner optimizer. The ``Trainer`` wraps the model and
builds its optimizer inside ``train()``; ``attach_trainer``'s callback attaches
to both there and reads the loss from the model's output. Lightning builds
DDP and the optimizer inside ``fit()``; ``lightning_callback`` attaches at
``on_train_start`` and reads the loss ``training_step`` returns.

Both: gradient accumulation 2, variable-length batches padded per batch, a bit
flipped in one rank's weights after one update from outside the loop. Each
must give one record per optimizer step, tokens from the keyword ``input_ids``
of both micro-batches, DDP's all-reduce, and the flip named ``sdc`` on its rank.
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


def _accelerate(rank: int, port: int, out: str, flip_rank: int, flip_step: int,
                comm_hook: bool = False) -> None:  # fmt: skip
    torchrun_env(rank, port)
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from rankscope.collectors import RankCollector

    # comm_hook: the user's own DDP hook, which prepare() registers before the attach
    hook = DDPCommunicationHookType.FP16 if comm_hook else DDPCommunicationHookType.NO
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM,
                              kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook)])
    torch.manual_seed(0)
    model = Classifier()
    loader = torch.utils.data.DataLoader(sequences(), batch_size=4, shuffle=True,
                                         collate_fn=collate)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    rc = RankCollector.attach(model, optimizer, job="accelerate", sink=f"file://{out}/trace",
                              host="node00")  # fmt: skip
    if rank == flip_rank:
        flip_after(optimizer.optimizer, flip_step, lambda: rc.step_index)
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


def _trainer(rank: int, port: int, out: str, flip_rank: int, flip_step: int) -> None:
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
            if rank == flip_rank:
                flip_after(trainer.optimizer.optimizer, flip_step, lambda: hooked.rc.step_index)

    trainer.add_callback(Flip())
    trainer.train()
    assert hooked.rc is not None and not hooked.rc.faults, hooked.rc.faults


def _lightning(rank: int, port: int, out: str, flip_rank: int, flip_step: int) -> None:
    torchrun_env(rank, port)
    import lightning as L
    from rankscope.collectors.integrations.lightning import lightning_callback

    class Module(L.LightningModule):  # the usual shape: a model, a step, its optimizer
        def __init__(self) -> None:
            super().__init__()
            self.net = Classifier()

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    hooked = lightning_callback(job="lightning", sink=f"file://{out}/trace", host="node00")

    class Flip(L.Callback):  # the fault, from outside the loop
        def on_train_start(self, trainer, pl_module):
            if rank == flip_rank:
                flip_after(trainer.optimizers[0], flip_step, lambda: hooked.rc.step_index)

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(sequences(), batch_size=4, collate_fn=collate)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=STEPS,
        accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(Path(out) / "pl"), callbacks=[hooked, Flip()],
    )  # fmt: skip
    trainer.fit(Module(), loader)
    assert hooked.rc is not None and not hooked.rc.faults, hooked.rc.faults


def _run_and_check(worker, tmp_path: Path, flip_rank: int, flip_step: int, *extra,
                   local: bool = True) -> dict:  # fmt: skip
    """``local``: the collector's DDP hook is in place, so the local norm is recorded."""
    mp.spawn(worker, args=(free_port(), str(tmp_path), flip_rank, flip_step, *extra),
             nprocs=WORLD, join=True)  # fmt: skip
    trace = read_trace(tmp_path / "trace")
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    steps = steps_of(trace)
    assert sorted(steps) == list(range(STEPS))  # optimizer steps, not micro-batches
    assert all(sorted(steps[s]) == list(range(WORLD)) for s in steps)
    tokens = [[steps[s][r]["tokens"] for r in range(WORLD)] for s in range(STEPS)]
    assert all(t >= 2 * 4 * 3 for row in tokens for t in row), tokens  # two micro-batches
    assert sum(len(set(row)) > 1 for row in tokens) >= STEPS // 2, tokens
    for s in range(flip_step):  # replicas agree until the flip
        assert len({steps[s][r]["param_digest"] for r in range(WORLD)}) == 1, s
        assert len({steps[s][r]["grad_norm_reduced"] for r in range(WORLD)}) == 1, s
        assert all(("grad_norm" in steps[s][r]) == local for r in range(WORLD)), s
    for r in range(WORLD):  # DDP's all-reduce, seen on the wrapped model
        colls = steps[3][r]["collectives"]
        # the user's hook reduces by itself, on DDP's group: the world here
        group = "dp" if local else "world"
        assert ("allreduce", group) in {(c["op"], c["group"]) for c in colls}, colls
        assert steps[3][r]["comm_s"] > 0

    found = replay_trace(tmp_path / "trace").findings
    sdc = [f for f in found if f.kind == "sdc"]
    assert [(f.ranks, f.first_step) for f in sdc] == [([flip_rank], flip_step)], found
    assert not [f for f in found if f.action in ("evict", "recover") and f.kind != "sdc"], found
    return steps


def test_an_accelerate_loop_with_accumulation_records_optimizer_steps_and_names_the_flip(
    tmp_path: Path,
):
    _run_and_check(_accelerate, tmp_path, flip_rank=2, flip_step=9)


def test_a_ddp_hook_of_the_users_own_is_kept_and_the_rest_recorded(tmp_path: Path):
    """DDP takes one communication hook for good, and ``prepare()`` registered the
    user's fp16 compression first. The attach once raised there; now it leaves that
    hook in place and the local norm out (said at WARNING), and records the rest."""
    _run_and_check(_accelerate, tmp_path, 0, 5, True, local=False)


def test_a_trainer_run_is_recorded_through_its_callback_and_the_flip_is_named(tmp_path: Path):
    steps = _run_and_check(_trainer, tmp_path, flip_rank=1, flip_step=7)
    assert all(0 < steps[s][r]["loss"] < 5 for s in steps for r in range(WORLD))


def test_a_lightning_run_is_recorded_through_its_callback_and_the_flip_is_named(tmp_path: Path):
    steps = _run_and_check(_lightning, tmp_path, flip_rank=3, flip_step=8)
    assert all(0 < steps[s][r]["loss"] < 5 for s in steps for r in range(WORLD))

"""Runs of loops that frameworks own, recorded for the false-alarm bench's scorer.

A Lightning ``Trainer.fit`` (``lightning``: a ``LightningModule`` around the
``varlen`` style's classifier, ``strategy="ddp"``, clipping) or a Hugging Face
``Trainer.train`` (``trainer``: the same model and variable-length batches,
warmup, logging every 10 steps), each on 4 gloo ranks of this host, attached the
way their users would (``lightning_callback``, ``attach_trainer``). The
framework initializes the process group itself, from torchrun's environment,
so every run is its own spawn. ``--faults`` adds a 1.5x straggler and a 20 ms
slow link from mid-run (``fa_faults.py``: a forward hook and an optimizer hook on
what the framework built, a DDP communication hook handed to the attach), each
installed by a callback of its own, outside the loop. The folders are in the
bench's corpus format::

    flock /tmp/rankscope-cpu.lock python bench/bench_framework_loops.py \\
        --record out/fw --kind lightning --clean 12 --steps 80 [--faults]
    python bench/bench_false_alarms.py --score out/fw -v
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fa_faults import StepClock, comm_hook_for, install_fault, label  # noqa: E402
from fa_record import HOST, next_index  # noqa: E402
from fa_varlen import TinyEncoderClassifier, _pad_collate, _Sequences  # noqa: E402

KINDS = ("lightning", "trainer")
WORLD = 4
FAULTS = {"straggler1.5": {"kind": "straggler", "factor": 1.5},
          "network0.02": {"kind": "network", "delay_s": 0.02}}  # fmt: skip


class _Built:
    """What ``install_fault`` needs of a loop: the module and optimizer the framework built."""

    ddp, faults, style = True, ("straggler", "network"), "framework"

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt


def _fault_kw(fault: dict | None, rank: int, clock: StepClock) -> dict:
    hook = comm_hook_for(fault, rank, WORLD, clock)
    return {"comm_hook": hook} if hook is not None else {}


def _lightning(out: str, steps: int, data, fault: dict | None, rank: int) -> None:
    import lightning as L
    from rankscope.collectors.integrations.lightning import lightning_callback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyEncoderClassifier()

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-4)

    clock = StepClock()
    hooked = lightning_callback(job=Path(out).name, sink=f"file://{out}", host=HOST,
                                **_fault_kw(fault, rank, clock))  # fmt: skip

    class Fault(L.Callback):  # before the collector's: its optimizer hook runs first
        def on_train_start(self, trainer, pl_module):
            install_fault(fault, rank, _Built(trainer.strategy.model, trainer.optimizers[0]),
                          clock)  # fmt: skip

    class Bind(L.Callback):
        def on_train_start(self, trainer, pl_module):
            clock.rc = hooked.rc

    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                         collate_fn=_pad_collate)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=steps,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out + ".lightning", callbacks=[Fault(), hooked, Bind()],
    )  # fmt: skip
    trainer.fit(Module(), loader)


def _trainer(out: str, steps: int, data, seed: int, fault: dict | None, rank: int) -> None:
    from rankscope.collectors.integrations.hf_trainer import attach_trainer
    from transformers import Trainer, TrainerCallback, TrainingArguments

    args = TrainingArguments(
        output_dir=out + ".trainer", use_cpu=True, ddp_backend="gloo",
        per_device_train_batch_size=8, max_steps=steps, learning_rate=5e-4, warmup_steps=5,
        logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True, seed=seed,
    )  # fmt: skip
    trainer = Trainer(model=TinyEncoderClassifier(), args=args, train_dataset=data,
                      data_collator=_pad_collate)  # fmt: skip
    clock = StepClock()

    class Fault(TrainerCallback):  # before the collector's: its optimizer hook runs first
        def on_train_begin(self, args, state, control, **kwargs):
            built = _Built(trainer.model_wrapped, trainer.optimizer.optimizer)
            install_fault(fault, rank, built, clock)

    class Bind(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.rc = hooked.rc

    trainer.add_callback(Fault())
    hooked = attach_trainer(trainer, job=Path(out).name, sink=f"file://{out}", host=HOST,
                            **_fault_kw(fault, rank, clock))  # fmt: skip
    trainer.add_callback(Bind())
    trainer.train()


def _worker(rank: int, port: int, out: str, kind: str, steps: int, seed: int,
            fault: dict | None) -> None:  # fmt: skip
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": rank, "LOCAL_RANK": rank,
           "WORLD_SIZE": WORLD, "LOCAL_WORLD_SIZE": WORLD}  # what torchrun sets  # fmt: skip
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 default gives
    torch.manual_seed(seed)
    data = _Sequences(torch.Generator().manual_seed(seed))
    if kind == "lightning":
        _lightning(out, steps, data, fault, rank)
    else:
        _trainer(out, steps, data, seed, fault, rank)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(corpus: Path, kind: str, clean: int, steps: int, faults: bool = False) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    first = next_index(corpus)
    runs = [(f"clean-{kind}", None)] * clean
    if faults:  # on ranks 1 and 2, from the middle of the run
        runs += [(f"fault-{tag}-{kind}", {**f, "rank": 1 + i, "from": steps // 2, "until": None})
                 for i, (tag, f) in enumerate(FAULTS.items())]  # fmt: skip
    for seed, (prefix, fault) in enumerate(runs, start=first):
        run = corpus / f"{prefix}-{seed:04d}"
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(_port(), str(run), kind, steps, seed, fault), nprocs=WORLD,
                 join=True)  # fmt: skip
        labels = label(fault, HOST, [fault["rank"]] if fault else None)
        (run / "labels.jsonl").write_text("".join(json.dumps(lab) + "\n" for lab in labels))
        meta = {"generator": "bench_framework_loops", "world": WORLD, "name": run.name,
                "style": kind, "seed": seed, "steps": steps, "fault": fault}  # fmt: skip
        (run / "meta.json").write_text(json.dumps(meta, indent=1))
        print(f"recorded {run.name} in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", metavar="DIR", required=True, help="record runs into DIR")
    ap.add_argument("--kind", choices=KINDS, required=True, help="the framework")
    ap.add_argument("--clean", type=int, default=1, help="clean runs to record")
    ap.add_argument("--faults", action="store_true",
                    help="and one run per fault (straggler 1.5x, slow link 20 ms)")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    a = ap.parse_args(argv)
    if a.clean < 0 or a.steps < 10 or not (a.clean or a.faults):
        ap.error("--clean must be >= 0 (with --faults) or >= 1, and --steps >= 10")
    record(Path(a.record), a.kind, a.clean, a.steps, a.faults)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Record a batch of runs: 4 real gloo processes, the real collector, file:// sinks.

One ``torch.multiprocessing.spawn`` per batch; inside it each run builds a
fresh model, wraps it the way its style does (DDP, FSDP2, tensor parallel x
FSDP2) over the same processes, installs its fault (if any) from outside the
loop, attaches ``RankCollector`` to its own trace folder, trains, closes.
Reusing the processes across runs keeps start-up (torch import, rendezvous)
from eating the 2 shared cores; every run still has its own model,
optimizer, collector and trace.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fa_faults import StepClock, comm_hook_for, install_fault, label
from fa_held import Board, peer_key
from fa_loops import build_loop

__all__ = ["next_index", "record_batch"]

HOST = "node00"  # one host: 4 ranks on this machine


def _worker(rank: int, world: int, init: str, runs: list[dict], out: str) -> None:
    share = os.path.dirname(init.removeprefix("file://"))  # this batch's temporary folder
    torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 default gives
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from rankscope.collectors import RankCollector

    try:
        for run in runs:
            fault = run.get("fault")
            loop = build_loop(run["style"], rank, world, run["seed"], run["steps"])
            module = loop.wrap()
            clock = StepClock()
            board = None
            if fault and fault.get("hold"):  # every rank posts its compute (fa_held.py)
                board = Board(os.path.join(share, f"board-{run['name']}"), world, rank)
            undo = install_fault(fault, rank, loop, clock, board, peer_key(loop.topology, rank),
                                 world)  # fmt: skip
            folder = Path(out) / run["name"]
            rc = RankCollector.attach(
                module, loop.opt, job=run["name"], sink=f"file://{folder}", host=HOST,
                topology=loop.topology,
                comm_hook=comm_hook_for(fault, rank, world, clock, loop.ddp),
            )  # fmt: skip
            clock.rc = rc
            for it in range(run["steps"]):
                loop.step(it, rc)
            rc.close()
            undo()
            dist.barrier()
            if board is not None:
                board.close()
            if rank == 0:
                ranks = loop.attributable(fault["kind"], fault["rank"]) if fault else None
                with open(folder / "labels.jsonl", "w") as fh:
                    for lab in label(fault, HOST, ranks):
                        fh.write(json.dumps(lab) + "\n")
                meta = {"generator": "bench_false_alarms", "world": world, **run}
                (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    finally:
        dist.destroy_process_group()


def next_index(corpus: Path) -> int:
    """The next free run number in ``corpus`` (runs are named ``...-NNNN``)."""
    if not corpus.is_dir():
        return 0
    nums = [int(p.name.rsplit("-", 1)[-1]) for p in corpus.iterdir()
            if p.is_dir() and p.name.rsplit("-", 1)[-1].isdigit()]  # fmt: skip
    return max(nums, default=-1) + 1


def record_batch(runs: list[dict], out: Path, world: int = 4) -> None:
    """Record ``runs`` (dicts: name, style, seed, steps, fault) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_worker, args=(world, init, runs, str(out)), nprocs=world, join=True)

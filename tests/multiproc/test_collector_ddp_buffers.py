"""DDP's buffer broadcast, timed as a collective on real gloo ranks.

A model with a registered buffer (nanoGPT's causal mask) makes DDP broadcast
it from rank 0 before each synchronizing forward. Rank 0 waits there for a
late peer; unrecorded, that wait was rank 0's compute, and a slow link on
another rank made rank 0 look like a straggler.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rankscope.pipeline.traces.files import read_trace

pytestmark = pytest.mark.multiproc

WORLD, STEPS = 3, 8
LATE_RANK, LATE_STEP, LATE_S = 2, 5, 0.3  # this rank reaches its forward this late


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 16)
        self.register_buffer("mask", torch.ones(16))  # what DDP broadcasts

    def forward(self, x):
        return self.l1(x) * self.mask


def _worker(rank: int, world: int, tmp: str) -> None:
    from rankscope.collectors import RankCollector

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(_Masked())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        rc = RankCollector.attach(ddp, opt, job="bufs", sink=f"file://{tmp}/trace")
        for step in range(STEPS):
            if rank == LATE_RANK and step == LATE_STEP:
                time.sleep(LATE_S)  # before the forward: this rank's own input wait
            opt.zero_grad()
            ddp(torch.randn(4, 16)).sum().backward()
            opt.step()
        rc.close()
        assert "_distributed_broadcast_coalesced" not in vars(ddp)  # unwrapped at close
    finally:
        dist.destroy_process_group()


def test_rank_0_waiting_in_the_buffer_broadcast_is_comm_not_compute(tmp_path):
    mp.spawn(_worker, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=True)
    steps = {(r["rank"], r["step"]): r for r in read_trace(tmp_path / "trace").records
             if r["type"] == "step"}  # fmt: skip
    assert len(steps) == WORLD * STEPS
    for (rank, step), r in steps.items():
        ops = [(c["op"], c["group"]) for c in r["collectives"]]
        assert ops == [("broadcast", "dp"), ("allreduce", "dp")], (rank, step, ops)
        seqs = [c["seq"] for c in r["collectives"]]
        assert seqs == [c["seq"] for c in steps[(0, step)]["collectives"]]  # same instances
    root = steps[(0, LATE_STEP)]
    (bcast,) = [c for c in root["collectives"] if c["op"] == "broadcast"]
    assert bcast["s"] >= 0.8 * LATE_S and bcast["bytes"] == 16 * 4
    assert root["comm_s"] >= bcast["s"] and root["compute_s"] < 0.5 * LATE_S, root

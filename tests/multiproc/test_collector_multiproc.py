"""The rank collector inside real multi-process gloo DDP training.

Each test spawns real ranks with a ``file://`` rendezvous under ``tmp_path``;
every rank writes its records through the collector's file sink, the parent
reads the trace back and asserts on the recorded values.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rankscope.pipeline.traces.files import read_trace
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

pytestmark = pytest.mark.multiproc

WORLD, STEPS, WARMUP = 3, 14, 3
FLIP_RANK, FLIP_STEP = 0, 5  # one parameter bit flipped on this replica after this step
BLOCK_RANK, BLOCK_STEP, BLOCK_S = 1, 8, 2.0  # this rank blocks in forward this long
SLOW_RANK, BASE_BACKWARD_S, SLOW_BACKWARD_FACTOR = 2, 0.015, 4.0  # backward 4x slower
ASSERTED_FACTOR = 3.0  # forward and optimizer are not slowed: whole compute >= 3x
BEAT_S = 0.2
NO_CLOSE_RANK = 2  # relies on the atexit flush
USER_HOOK_RANK = 1  # passes its own DDP communication hook


class _Block(torch.nn.Module):
    """Sleeps in forward at one step on one rank: a rank blocked in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.sleep_s = 0.0

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return x


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``delay_s``: backward compute of a known length."""

    @staticmethod
    def forward(ctx, x, delay_s):
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay_s)
        return grad, None


class _Net(torch.nn.Module):
    def __init__(self, backward_delay_s: float = 0.0) -> None:
        super().__init__()
        self.block = _Block()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 1)
        self.backward_delay_s = backward_delay_s

    def forward(self, x):
        h = torch.relu(self.l1(self.block(x)))
        if self.backward_delay_s:
            h = _SlowBackward.apply(h, self.backward_delay_s)
        return self.l2(h)


def _flip_bit_(t: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] ^= 1 << bit


def _init(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)


def _worker(rank: int, world: int, tmp: str) -> None:
    """DDP training with different data per rank, one slow-backward rank, a
    one-bit parameter flip on one replica, and one rank blocked in forward."""
    from rankscope.collectors import RankCollector

    _init(rank, world, tmp)
    try:
        torch.manual_seed(0)
        factor = SLOW_BACKWARD_FACTOR if rank == SLOW_RANK else 1.0
        net = _Net(backward_delay_s=BASE_BACKWARD_S * factor)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        step_box = [0]
        if rank == FLIP_RANK:  # registered before attach: seen by this step's digest

            def flip(optimizer, args, kwargs):
                if step_box[0] == FLIP_STEP:
                    _flip_bit_(net.l1.weight, 3, 10)

            opt.register_step_post_hook(flip)
        # one rank brings its own DDP comm hook (which calls dist.all_reduce
        # itself): the collector wraps it and must not record that call twice
        user_hook = default_hooks.allreduce_hook if rank == USER_HOOK_RANK else None
        rc = RankCollector.attach(
            ddp,
            opt,
            job="mp",
            sink=f"file://{tmp}/trace",
            beat_interval_s=BEAT_S,
            comm_hook=user_hook,
        )
        gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
        for step in range(STEPS):
            step_box[0] = step
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            net.block.sleep_s = BLOCK_S if (rank == BLOCK_RANK and step == BLOCK_STEP) else 0.0
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            rc.loss(loss)  # after the step: the collector holds the record for it
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # an explicit collective the loop makes
        Path(tmp, f"stats{rank}").write_text(repr(rc.stats))
        if rank != NO_CLOSE_RANK:
            rc.close()
    finally:
        dist.destroy_process_group()


def _by_rank_step(records: list[dict]) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["type"] == "step":
            out[r["rank"]][r["step"]] = r
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real 3-rank gloo run shared by the tests below (spawning costs seconds)."""
    tmp = tmp_path_factory.mktemp("collector_mp")
    mp.spawn(_worker, args=(WORLD, str(tmp)), nprocs=WORLD, join=True)
    trace = read_trace(tmp / "trace")
    return tmp, trace, _by_rank_step(trace.records)


def _med(steps_by, rank: int, field: str) -> float:
    return statistics.median(
        steps_by[rank][s][field] for s in range(WARMUP, STEPS) if s != BLOCK_STEP
    )


def test_every_rank_reports_every_step_including_the_atexit_flush(run):
    tmp, trace, steps_by = run
    assert trace.report.bad == 0, trace.report.errors[:3]
    assert sorted(steps_by) == list(range(WORLD))
    for rank in range(WORLD):
        assert sorted(steps_by[rank]) == list(range(STEPS)), rank
        assert "dropped_queue_full=0" in (tmp / f"stats{rank}").read_text()
        for r in steps_by[rank].values():
            assert r["world"] == WORLD and r["dp"] == rank and r["tp"] == 0 and r["pp"] == 0
            assert r["loss"] > 0 and r["lr"] == 0.05 and r["nonfinite"] == 0
            assert min(r["compute_s"], r["comm_s"], r["data_s"]) >= 0
            assert r["compute_s"] + r["comm_s"] + r["data_s"] == pytest.approx(r["step_s"])
            assert 0 <= r.get("cpu_wait_s", 0) <= r["step_s"]  # absent: no Linux schedstat


def test_local_norms_differ_while_reduced_norms_are_equal(run):
    _, _, steps_by = run
    for step in range(STEPS):
        local = [steps_by[r][step]["grad_norm"] for r in range(WORLD)]
        reduced = [steps_by[r][step]["grad_norm_reduced"] for r in range(WORLD)]
        assert len(set(local)) == WORLD, (step, local)  # different data per rank
        assert len(set(reduced)) == 1, (step, reduced)  # one reduced gradient
        assert reduced[0] < max(local)


def test_digest_equal_on_replicas_until_one_bit_flips(run):
    _, _, steps_by = run
    for step in range(STEPS):
        digests = [steps_by[r][step]["param_digest"] for r in range(WORLD)]
        healthy = {d for rank, d in enumerate(digests) if rank != FLIP_RANK}
        assert len(healthy) == 1, (step, digests)
        assert (digests[FLIP_RANK] in healthy) == (step < FLIP_STEP), (step, digests)


def test_collectives_from_ddp_hook_and_loop_line_up_across_ranks(run):
    _, _, steps_by = run
    for step in range(STEPS):
        colls = steps_by[0][step]["collectives"]
        ddp = [c for c in colls if c["group"] == "dp"]
        assert ddp and all(c["op"] == "allreduce" and c["bytes"] > 0 for c in ddp)
        loop = [c for c in colls if c["group"] == "world"]
        assert len(loop) == (1 if step else 0)  # the loop's all_reduce after step N-1
        for c in colls:
            assert c["s"] >= 0 and c["seq"] >= 1 and c["t0"] > 0
        for rank in range(1, WORLD):
            other = [(c["op"], c["group"], c["seq"]) for c in steps_by[rank][step]["collectives"]]
            assert other == [(c["op"], c["group"], c["seq"]) for c in colls]


def test_straggler_stands_out_in_compute_not_comm(run):
    _, _, steps_by = run
    peers = [r for r in range(WORLD) if r != SLOW_RANK]
    slow_compute = _med(steps_by, SLOW_RANK, "compute_s")
    peer_compute = statistics.median(_med(steps_by, r, "compute_s") for r in peers)
    assert slow_compute >= ASSERTED_FACTOR * peer_compute, (slow_compute, peer_compute)
    for r in peers:  # the peers spent the difference waiting in the all-reduce
        assert _med(steps_by, r, "comm_s") > _med(steps_by, SLOW_RANK, "comm_s") + BASE_BACKWARD_S
        assert _med(steps_by, r, "step_s") == pytest.approx(
            _med(steps_by, SLOW_RANK, "step_s"), rel=0.3
        )


def test_beats_keep_coming_while_a_rank_is_blocked(run):
    _, trace, steps_by = run
    for rank in range(WORLD):  # the peers waited for the blocked rank in the all-reduce
        if rank != BLOCK_RANK:
            assert steps_by[rank][BLOCK_STEP]["comm_s"] > BLOCK_S * 0.7
    beats = defaultdict(list)
    for r in trace.records:
        if r["type"] == "beat" and r["step"] == BLOCK_STEP:
            beats[r["rank"]].append(r)
    # blocked rank: in forward, its last collective (the loop's, step 7) completed
    stuck = [b for b in beats[BLOCK_RANK] if b["phase"] == "forward"]
    assert len(stuck) >= 5, [b["phase"] for b in beats[BLOCK_RANK]]
    assert all(b["coll_done"] is True and b["coll_group"] == "world" for b in stuck)
    for rank in range(WORLD):
        if rank == BLOCK_RANK:
            continue
        # peers: waiting in the gradient all-reduce the blocked rank has not entered
        # (a beat may also land in the loop's short world barrier that opens step 8)
        waiting = [b for b in beats[rank] if b["phase"] == "collective"
                   and b["coll_group"] == "dp"]  # fmt: skip
        assert len(waiting) >= 5, [(b["phase"], b.get("coll_group")) for b in beats[rank]]
        assert all(b["coll_done"] is False for b in waiting), waiting


def _mesh_worker(rank: int, world: int, tmp: str) -> None:
    from rankscope.collectors import RankCollector
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rc = RankCollector.attach(model, opt, job="mesh", sink=f"file://{tmp}/trace", topology=mesh)
        for _ in range(2):
            t = torch.ones(3)
            dist.all_reduce(t, group=mesh.get_group("tp"))  # named by its mesh axis
            dist.barrier()  # default group: "world"
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        rc.close()
    finally:
        dist.destroy_process_group()


def test_device_mesh_gives_coordinates_and_group_names(tmp_path):
    mp.spawn(_mesh_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    steps = _by_rank_step(read_trace(tmp_path / "trace").records)
    for rank in range(2):
        rec = steps[rank][1]
        assert (rec["dp"], rec["tp"], rec["pp"]) == (0, rank, 0)
        assert [(c["op"], c["group"], c["seq"]) for c in rec["collectives"]] == [
            ("allreduce", "tp", 2),
            ("barrier", "world", 2),
        ]
        assert rec["collectives"][0]["bytes"] == 12

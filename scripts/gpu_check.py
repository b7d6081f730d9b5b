"""One prepared check of the rank collector on a real GPU (for a lent device; < 5 min).

1. No sync: a loop with the collector attached under
   ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/test_gpu_collector_no_sync.py).
2. Timing: a step whose device work is a known ``torch.cuda._sleep``; prints the
   recorded ``compute_s`` beside the device time. Today the collector times with
   the CPU clock (``perf_counter``): the figure shows how far that is from device
   time (CUDA-event timing is not built yet).
3. Two ranks sharing the GPU over gloo (NCCL cannot put two ranks on one device),
   rank 1 with 1.5x the device sleep: prints both ranks' compute_s and comm_s.

Usage: ``python scripts/gpu_check.py`` (prints figures; exit 1 on a failed check).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _loop(sleep_ms: float, steps: int, sink: str) -> None:
    from rankscope.collectors import RankCollector

    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="cuda")
    rc = RankCollector.attach(model, opt, job="gpu-check", sink=sink)
    cycles = int(sleep_ms * _cycles_per_ms())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.cuda._sleep(cycles)  # known device time in the step
        loss = model(x).square().mean()
        loss.backward()
        rc.loss(loss)
        opt.step()
    rc.close()


def check_no_sync() -> bool:
    import pytest

    return pytest.main(["-q", "-m", "gpu", os.path.join(ROOT, "tests/gpu")]) == 0


def check_timing(tmp: str) -> None:
    from rankscope.pipeline.traces.files import read_trace

    _loop(20.0, 10, f"file://{tmp}/single")
    steps = [r for r in read_trace(f"{tmp}/single").records if r["type"] == "step"]
    cs = sorted(r["compute_s"] for r in steps[2:])
    print(f"timing: device sleep 20.0 ms/step, recorded compute_s median "
          f"{cs[len(cs) // 2] * 1e3:.1f} ms (CPU clock)")  # fmt: skip


def _rank(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2)
    try:
        from rankscope.collectors import RankCollector
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(256, 256).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 256, device="cuda")
        rc = RankCollector.attach(model, opt, job="gpu-pair", sink=f"file://{tmp}/pair")
        cycles = int((30.0 if rank == 1 else 20.0) * _cycles_per_ms())
        for _ in range(12):
            opt.zero_grad(set_to_none=True)
            torch.cuda._sleep(cycles)
            loss = model(x).square().mean()
            loss.backward()
            rc.loss(loss)
            opt.step()
        rc.close()
    finally:
        dist.destroy_process_group()


def check_pair(tmp: str) -> None:
    from rankscope.pipeline.traces.files import read_trace

    mp.spawn(_rank, args=(tmp,), nprocs=2, join=True)
    steps = [r for r in read_trace(f"{tmp}/pair").records if r["type"] == "step"]
    for rank in (0, 1):
        mine = sorted((r for r in steps if r["rank"] == rank), key=lambda r: r["step"])[2:]
        cs = sorted(r["compute_s"] for r in mine)
        cm = sorted(r["comm_s"] for r in mine)
        print(f"pair: rank {rank} device sleep {30 if rank else 20} ms: compute_s "
              f"{cs[len(cs) // 2] * 1e3:.1f} ms, comm_s {cm[len(cm) // 2] * 1e3:.1f} ms")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    sys.path.insert(0, ROOT)
    t0 = time.time()
    ok = check_no_sync()
    with tempfile.TemporaryDirectory() as tmp:
        check_timing(tmp)
        check_pair(tmp)
    print(f"no-sync check {'passed' if ok else 'FAILED'}; {time.time() - t0:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

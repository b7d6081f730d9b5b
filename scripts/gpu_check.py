"""One prepared check of the rank collector on a real GPU (for a lent device; < 5 min).

1. timing: a step whose device work is a known ``torch.cuda._sleep``; with
   device timing its ``compute_s`` matches the sleep, with the CPU clock
   (``device_timing=False``) it does not (the host only launched it).
2. no-sync: the same loop, collector attached, under
   ``torch.cuda.set_sync_debug_mode("error")`` until the collector closed (the
   sender's reads included): records complete, no collector fault.
3. pair: two processes sharing the GPU over gloo (NCCL cannot put two ranks on
   one device), DDP, rank 1 with 1.5x the device sleep: rank 1's compute_s
   is the larger, rank 0's comm_s is (it waits for rank 1).

Prints PASS/FAIL per check; exit 1 when one failed. ``--device cpu`` runs the
pair check on CPU (``time.sleep`` as the slow "kernel"): tests/multiproc runs
that, and tests/gpu runs the checks where CUDA exists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP_MS = 20.0
# per-rank device work of the pair check: 1.5x on rank 1; on CPU three times longer,
# so that a shared host's scheduling noise (~10 ms a step) stays below the signal
PAIR_MS = {"cuda": (20.0, 30.0), "cpu": (60.0, 90.0)}


def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _work(device: str, ms: float, cycles_per_ms: float | None) -> None:
    """``ms`` of device work: a spinning kernel on CUDA, a host sleep on CPU."""
    if device == "cuda":
        torch.cuda._sleep(int(ms * cycles_per_ms))
    else:
        time.sleep(ms / 1e3)


def _steps(path: str) -> list[dict]:
    from rankscope.pipeline.traces.files import read_trace

    trace = read_trace(path)
    return [r for r in trace.records if r["type"] == "step"]


def _median(recs: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in recs)


def run_single(sink: str, *, steps: int = 10, device_timing: bool | None = None,
               no_sync: bool = False) -> dict:  # fmt: skip
    """A one-rank loop with ``SLEEP_MS`` of device work per step; the collector's counters."""
    from rankscope.collectors import CollectorConfig, RankCollector

    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="cuda")
    cycles = _cycles_per_ms()
    cfg = CollectorConfig(device_timing=device_timing)
    rc = RankCollector.attach(model, opt, job="gpu-check", sink=sink, rank=0, world=1,
                              config=cfg)  # fmt: skip
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            _work("cuda", SLEEP_MS, cycles)  # known device time inside the step
            loss.backward()
            rc.loss(loss)
            opt.step()
        rc.close()  # the sender's reads happen under the debug mode too
    finally:
        torch.cuda.set_sync_debug_mode("default")
    timing = rc.device_timing
    return {"faults": rc.faults, "resolved": timing.resolved if timing else 0,
            "fallback": timing.fallback if timing else 0}  # fmt: skip


def judge_timing(device: list[dict], cpu: list[dict]) -> tuple[bool, str]:
    dev, host = _median(device[2:], "compute_s") * 1e3, _median(cpu[2:], "compute_s") * 1e3
    ok = abs(dev - SLEEP_MS) < 0.25 * SLEEP_MS and host < 0.5 * SLEEP_MS
    return ok, (f"device sleep {SLEEP_MS:.0f} ms/step: compute_s {dev:.1f} ms with device "
                f"timing, {host:.1f} ms with the CPU clock")  # fmt: skip


def check_timing(tmp: str) -> tuple[bool, str]:
    info = run_single(f"file://{tmp}/dev")
    run_single(f"file://{tmp}/cpu", device_timing=False)
    ok, msg = judge_timing(_steps(f"{tmp}/dev"), _steps(f"{tmp}/cpu"))
    return ok and info["resolved"] >= 8 and not info["faults"], f"{msg}; {info}"


def check_no_sync(tmp: str) -> tuple[bool, str]:
    try:
        info = run_single(f"file://{tmp}/nosync", no_sync=True)
    except RuntimeError as exc:  # a synchronizing call on the training thread
        return False, f"raised under sync debug mode 'error': {exc}"
    recs = _steps(f"{tmp}/nosync")
    full = all("grad_norm" in r and "loss" in r and "param_digest" in r for r in recs)
    ok = len(recs) == 10 and full and not info["faults"] and info["fallback"] == 0
    return ok, f"{len(recs)} step records, all fields: {full}; {info}"


def _pair_rank(rank: int, tmp: str, device: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2)
    try:
        from rankscope.collectors import RankCollector
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(256, 256).to(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 256, device=device)
        cycles = _cycles_per_ms() if device == "cuda" else None
        rc = RankCollector.attach(model, opt, job="gpu-pair", sink=f"file://{tmp}/pair")
        for _ in range(12):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            _work(device, PAIR_MS[device][rank], cycles)
            out.square().mean().backward()
            opt.step()
        rc.close()
    finally:
        dist.destroy_process_group()


def judge_pair(steps: list[dict], device: str = "cuda") -> tuple[bool, str]:
    mine = {r: [s for s in steps if s["rank"] == r and s["step"] >= 2] for r in (0, 1)}
    cs = {r: _median(mine[r], "compute_s") * 1e3 for r in mine}
    cm = {r: _median(mine[r], "comm_s") * 1e3 for r in mine}
    ms = PAIR_MS[device]
    extra = ms[1] - ms[0]
    ok = cs[1] - cs[0] > 0.5 * extra and cm[0] - cm[1] > 0.5 * extra
    return ok, "; ".join(f"rank {r} ({ms[r]:.0f} ms): compute_s {cs[r]:.1f} ms, "
                         f"comm_s {cm[r]:.1f} ms" for r in (0, 1))  # fmt: skip


def check_pair(tmp: str, device: str = "cuda") -> tuple[bool, str]:
    mp.spawn(_pair_rank, args=(tmp, device), nprocs=2, join=True)
    return judge_pair(_steps(f"{tmp}/pair"), device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device here (--device cpu runs the pair check on CPU)")
        return 1
    sys.path.insert(0, ROOT)
    checks = [("pair", lambda tmp: check_pair(tmp, args.device))]
    if args.device == "cuda":
        checks = [("timing", check_timing), ("no-sync", check_no_sync)] + checks
    failed, t0 = 0, time.time()
    for name, check in checks:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                ok, msg = check(tmp)
            except Exception as exc:
                ok, msg = False, f"{type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {msg}", flush=True)
    print(f"{len(checks) - failed}/{len(checks)} checks passed in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The collector's own training-thread time by wrapper: DDP, FSDP2, and none.

Same LM workload and 2 gloo ranks as ``bench_collector_overhead.py``; per
wrapper, a plain block (no collector) and a collected block run alternately
on two identical models, and the collector's self-timing (``rc.self_time``)
is divided by the collected steps. The local gradient norm is counted apart
(``grad_norm_s``, the measurement itself): DDP's from its buckets, FSDP2's
from its reduce-scatter input, and a plain module's (``manual``: the loop
all-reduces each ``.grad`` itself, as PyTorch's distributed tutorial does)
from each all-reduce input (collectors/rank/manual_reduce.py). Prints
figures, asserts nothing.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from overhead_sinks import NullSink
from overhead_workloads import WORKLOADS
from rankscope.collectors import RankCollector
from torch.distributed import distributed_c10d

WRAPPERS = ("ddp", "fsdp2", "manual")


def _wrap(kind: str, model):
    if kind == "manual":
        return model  # the step averages the gradients itself (_averaging)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _averaging(collected: bool):
    """The tutorial's loop: one all-reduce per gradient, then divide by the world. The
    collected arm calls ``dist.all_reduce`` as a loop does (the collector wrapped it at
    attach); the plain arm the unwrapped function, so it pays nothing of the other's."""

    def average(model) -> None:
        reduce = dist.all_reduce if collected else distributed_c10d.all_reduce
        world = dist.get_world_size()
        for p in model.parameters():
            if p.grad is not None:
                reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world

    return average


def _steps(model, opt, work, x, y, n: int, rc, reduce=None) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        work.step(model, opt, x, y, rc, after_backward=reduce)
        times.append(time.perf_counter() - t0)
    return times


def measure(kind: str, rank: int, steps: int, block: int = 4) -> dict:
    """Alternate plain and collected blocks of one wrapper; figures for this rank."""
    work = WORKLOADS["lm"]()
    x, y = work.make_batch(rank)
    arms = {}
    for arm in ("plain", "collected"):
        torch.manual_seed(0)
        model = _wrap(kind, work.make_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rc = None
        if arm == "collected":
            rc = RankCollector.attach(model, opt, job=f"bench-{kind}", sink=NullSink())
        reduce = _averaging(rc is not None) if kind == "manual" else None
        _steps(model, opt, work, x, y, 3, rc, reduce)  # warm-up
        arms[arm] = {"model": model, "opt": opt, "rc": rc, "t": [], "reduce": reduce}
    start = arms["collected"]["rc"].self_time
    for _ in range(max(1, steps // block)):
        for arm in arms.values():
            arm["t"] += _steps(arm["model"], arm["opt"], work, x, y, block, arm["rc"],
                               arm["reduce"])  # fmt: skip
    rc = arms["collected"]["rc"]
    own = rc.self_time.minus(start)
    rc.close()
    n = len(arms["collected"]["t"])
    step_plain = statistics.median(arms["plain"]["t"])
    step_coll = statistics.median(arms["collected"]["t"])
    return {
        "kind": kind,
        "steps": n,
        "step_plain_ms": step_plain * 1e3,
        "step_collected_ms": step_coll * 1e3,
        "own_us": own.overhead_s / n * 1e6,
        "grad_norm_us": own.grad_norm_s / n * 1e6,
        "coll_us": own.collectives_s / n * 1e6,
        "digest_us": own.digest_s / n * 1e6,
        "hooks_us": (own.hooks_s + own.comm_hook_s) / n * 1e6,
        "own_pct": 100 * own.overhead_s / n / step_plain,
        "faults": rc.faults,
    }


def print_figures(rows: list[dict]) -> None:
    print("\n[lm] collector self-time by wrapper (2 gloo ranks, plain/collected blocks alternate)")
    print("wrapper rank  steps  plain step ms  collected step ms  ratio  own us/step  "
          "own % of step  (collectives  digest  hooks us)  grad-norm us/step")  # fmt: skip
    for r in rows:
        print(f"{r['kind']:7s} {r['rank']:4d} {r['steps']:6d} {r['step_plain_ms']:14.2f} "
              f"{r['step_collected_ms']:18.2f} {r['step_collected_ms'] / r['step_plain_ms']:6.3f} "
              f"{r['own_us']:12.0f} {r['own_pct']:14.2f} {r['coll_us']:14.0f} "
              f"{r['digest_us']:7.0f} {r['hooks_us']:6.0f} {r['grad_norm_us']:18.0f}"
              + (f"  faults {r['faults']}" if r["faults"] else ""))  # fmt: skip


def _wrapper_worker(rank: int, tmp: str, steps: int, world: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv-w", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        out.put([dict(measure(kind, rank, steps), rank=rank) for kind in WRAPPERS])
    finally:
        dist.destroy_process_group()


def run_wrappers(steps: int, ctx, world: int) -> None:
    """Measure both wrappers on ``world`` spawned gloo ranks and print the table."""
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_wrapper_worker, args=(r, tmp, steps, world, out))
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        rows = [row for _ in procs for row in out.get(timeout=1800)]
        for p in procs:
            p.join()
    print_figures(sorted(rows, key=lambda r: (r["kind"], r["rank"])))

"""What the rank collector costs the training thread, and what a stalled sink costs.

Runs CPU DDP training (2 gloo ranks) of two small models (bench/
overhead_workloads.py: an MLP on 32 samples a step, the worst case for the
collector's per-parameter costs, and a small causal transformer LM on 1,024
tokens a step, the shape of real training) and, for each, in ONE run,
interleaves identical DDP models ("arms"), each adding one part of the
collector (the LM, whose steps are 20x longer and which clips its gradients
as LM loops do, runs only the first and the last, with more rounds):

* ``plain``: DDP's own C++ reduction, no collector;
* ``hook``: the collector's Python communication hook in pass-through mode
  (routing the reduction through Python, measuring nothing);
* ``no-digest``: the collector attached with ``digest_every_steps=0``;
* ``collector``: the collector as shipped (digest every step).

Every arm kind runs as ``--instances`` identical models (default 2): two
models built alike differ in speed by up to a few percent, which one model
per kind would report as overhead; a kind's figure per round is the mean
over its models and the difference of two plain models is printed as the
noise floor. Arms run in blocks of a few steps, their order rotated every
round, and each block is timed as a whole INCLUDING a join of the
collector's digest worker at its end, so work the collector moved off the
training thread but that the step still waits for is charged to the arm that
caused it. The overhead is the median over rounds of (arm block - plain
block) / steps, in wall time and in the training thread's own CPU time plus
its waits for the digest worker (``time.thread_time``: not inflated while
the thread sits runnable behind other processes). Beside them, the
collector's own self-timing (``rc.self_time``: its code on the training
thread by part, the local norm pass and the all-reduce launch apart), whose
noise is a few microseconds where before/after differences carry hundreds.
The budget from the issue: the collector's cost on the training thread
without the local gradient-norm pass at most max(1% of the plain step,
100 us); the verdict is NOT met when the self-timed cost exceeds it or the
before/after interval lies wholly above it. The sender thread's per-record
work (building the record, hashing the digest) is off the training thread;
it is timed alone and printed.

Then attaches a collector whose sink stalls for 5 s in its first send, trains
a fixed number of steps through the stall, and prints how many records were
dropped and whether the loop finished while the sink was still stalled.

    .venv/bin/python bench/bench_collector_overhead.py [--steps 300] [--block 10] \
        [--lm-steps 120] [--lm-block 2] [--workloads mlp,lm] [--instances 2] \
        [--digest auto|inline|worker]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overhead_sinks import NullSink, StallingSink  # noqa: E402
from overhead_workloads import WORKLOADS, Workload  # noqa: E402
from rankscope.collectors import CollectorConfig, RankCollector  # noqa: E402
from rankscope.collectors.rank.ddp_hook import HookContext, make_ddp_hook  # noqa: E402
from rankscope.collectors.rank.digest import DigestPlan, digest_hex  # noqa: E402
from rankscope.collectors.rank.grad_stats import tensor_norm_stats  # noqa: E402
from rankscope.collectors.rank.step_record import build_step_record  # noqa: E402
from rankscope.collectors.rank.step_state import StepState  # noqa: E402

WORLD = 2
STALL_STEPS = 300
WARMUP_ROUNDS = 2
ARMS = ("plain", "hook", "no-digest", "collector")
# the LM's steps are ~20x longer: only the two arms the verdict needs, more rounds
ARMS_OF = {"mlp": ARMS, "lm": ("plain", "collector")}
# the collector's self-timed parts (collectors/rank/self_time.py), per step
SELF_PARTS = ("overhead_s", "hooks_s", "comm_hook_s", "digest_s", "collectives_s", "grad_norm_s",
              "launch_s")  # fmt: skip


def _time_us(fn, repeat: int = 200) -> float:
    """Median of single calls: robust to the other rank grabbing the CPU."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _q25(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]


def _arm_stats(per_step: list[float], plain: list[float], cpu: list[float], cpu0) -> dict:
    pairs = [a - p for a, p in zip(per_step, plain, strict=True)]
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [0.0, 0.0, 0.0]
    return {
        # 95% notch of the median (McGill et al.): 1.58 IQR / sqrt(n)
        "pair_ci_us": 1.58 * (q[2] - q[0]) / len(pairs) ** 0.5 * 1e6,
        "median_us": statistics.median(per_step) * 1e6,
        "pair_over_us": statistics.median(pairs) * 1e6,
        "q25_over_us": (_q25(per_step) - _q25(plain)) * 1e6,
        "cpu_over_us": (statistics.median(cpu) - statistics.median(cpu0)) * 1e6,
    }


def _thread_stats(arm: list[float], plain: list[float]) -> dict:
    """Training-thread cost per step against plain: median of per-round differences
    with its 95% notch. Thread CPU time does not count time the thread sat runnable
    while another thread or process had the core, so it is far less noisy than wall
    time on a shared machine."""
    pairs = [a - p for a, p in zip(arm, plain, strict=True)]
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [0.0, 0.0, 0.0]
    return {
        "thread_over_us": statistics.median(pairs) * 1e6,
        "thread_ci_us": 1.58 * (q[2] - q[0]) / len(pairs) ** 0.5 * 1e6,
    }


def _make_arm(name: str, work: Workload, background: bool | None = None):
    model = torch.nn.parallel.DistributedDataParallel(work.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rc = None
    if name == "hook":
        ctx = HookContext(StepState(), "dp", None, None, None)
        ctx.active = False  # pass-through: the reduction's Python route only
        model.register_comm_hook(None, make_ddp_hook(ctx))
    elif name != "plain":
        cfg = CollectorConfig(
            digest_every_steps=1 if name == "collector" else 0,
            digest_in_background=background,
        )
        rc = RankCollector.attach(model, opt, job="bench", sink=NullSink(), config=cfg)
    return model, opt, rc


def _block(model, opt, rc, x, y, steps: int, work: Workload) -> tuple:
    """Wall, process-CPU (all threads: the collector's too) and training-thread CPU
    seconds for ``steps`` steps, the seconds the training thread waited for the
    digest worker (including the wait for the digest in flight at the end), and the
    collector's self-timed seconds by part (``rc.self_time``; None without one)."""
    digester = getattr(rc, "_digester", None)
    waited0 = getattr(digester, "waited_s", 0.0)
    before = rc.self_time if rc is not None else None
    t_thread, c0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        work.step(model, opt, x, y, rc)
    final_join = 0.0
    if digester is not None:
        t_join = time.perf_counter()
        digester.join()  # charge the last digest in flight to this block
        final_join = time.perf_counter() - t_join
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    thread = time.thread_time() - t_thread
    spent = None
    if rc is not None:
        spent = rc.self_time.minus(before)
        spent.digest_s += final_join
    return wall, cpu, thread, getattr(digester, "waited_s", 0.0) - waited0, spent


def _interleaved(
    rank: int, work: Workload, steps: int, block: int, background: bool | None, instances: int
) -> dict:
    """Every arm kind as ``instances`` identical models, all blocks interleaved.

    Two models built alike still differ in speed by up to a few percent (where
    their tensors landed in memory), which would pass for overhead if each kind
    had one model. Each kind's figure per round is the mean over its instances,
    and the spread between two plain instances is printed as the noise floor.
    """
    kinds = ARMS_OF[work.name]
    names = [f"{kind}#{j}" for kind in kinds for j in range(1, instances + 1)]
    arms = {name: _make_arm(name.split("#")[0], work, background) for name in names}
    x, y = work.make_batch(rank)
    rounds = max(1, steps // block)
    per_step: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    thread: dict[str, list[float]] = {name: [] for name in names}
    own: dict[str, list[float]] = {part: [] for part in SELF_PARTS}
    for i in range(rounds + WARMUP_ROUNDS):
        k = i % len(names)  # rotate the order: no arm always runs first
        for name in names[k:] + names[:k]:
            wall, cpu_s, thread_s, waited_s, spent = _block(*arms[name], x, y, block, work)
            if i >= WARMUP_ROUNDS:
                per_step[name].append(wall / block)
                cpu[name].append(cpu_s / block)
                # the training thread's own CPU plus its waits for the collector's worker
                thread[name].append((thread_s + waited_s) / block)
                if name.startswith("collector#"):
                    for part in SELF_PARTS:
                        own[part].append(getattr(spent, part) / block)

    def by_kind(series: dict[str, list[float]]) -> dict[str, list[float]]:
        return {
            kind: [
                statistics.fmean(v)
                for v in zip(*(series[f"{kind}#{j}"] for j in range(1, instances + 1)), strict=True)
            ]
            for kind in kinds
        }

    wall_k, cpu_k, thread_k = by_kind(per_step), by_kind(cpu), by_kind(thread)
    plain = wall_k["plain"]
    result = {
        "plain_us": statistics.median(plain) * 1e6,
        "rounds": rounds,
        "block": block,
        "instances": instances,
        "describe": work.describe,
    }
    for kind in kinds[1:]:
        result[kind] = _arm_stats(wall_k[kind], plain, cpu_k[kind], cpu_k["plain"])
        result[kind].update(_thread_stats(thread_k[kind], thread_k["plain"]))
    if instances > 1:  # two identical plain models: what a difference of nothing looks like
        result["null"] = _arm_stats(
            per_step["plain#2"], per_step["plain#1"], cpu["plain#2"], cpu["plain#1"]
        )
        result["null"].update(_thread_stats(thread["plain#2"], thread["plain#1"]))
    result["self_us"] = {part: statistics.median(v) * 1e6 for part, v in own.items()}
    digesters = [
        getattr(arms[n][2], "_digester", None) for n in names if n.startswith("collector#")
    ]
    steps_run = (rounds + WARMUP_ROUNDS) * block * instances
    result["digest_taken_over"] = sum(getattr(d, "stolen", 0) for d in digesters) / steps_run
    result["digest_waited"] = sum(getattr(d, "waits", 0) for d in digesters) / steps_run
    # parts timed alone, on this rank's real gradient bucket and parameters
    model, opt, rc = arms["collector#1"]
    params = list(model.parameters())
    grads = torch.cat([p.grad.detach().reshape(-1) for p in params if p.grad is not None])
    result["params"] = grads.numel()
    result["norm_us"] = _time_us(lambda: tensor_norm_stats(grads))
    plan = DigestPlan(params)
    result["digest_sums_us"] = _time_us(plan.sums)
    stacks = plan.sums()
    result["digest_hash_us"] = _time_us(lambda: digest_hex(stacks))
    pending = {
        "step": 1, "t": time.time(), "step_s": 0.005, "data_s": 0.0, "comm_s": 0.001,
        "compute_s": 0.004, "local": [1.0], "reduced": [0.5], "nonfinite": [0],
        "collectives": [{"op": "allreduce", "group": "dp", "seq": 1, "bytes": 4, "s": 1e-4}],
        "loss": torch.tensor(2.0), "digest": lambda: digest_hex(stacks), "lr": 0.01, "tokens": None,
    }  # fmt: skip
    base = {"job": "bench", "rank": 0, "world": WORLD, "host": "h"}  # what the collector stamps
    result["record_us"] = _time_us(lambda: build_step_record(base, pending))
    for _, _, rc in arms.values():
        if rc is not None:
            rc.close()
    return result


def _stalled(work: Workload, rank: int) -> dict:
    """A fixed number of steps (every rank must run the same DDP steps) through a stall."""
    x, y = work.make_batch(rank)
    model = torch.nn.parallel.DistributedDataParallel(work.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = StallingSink(5.0)
    rc = RankCollector.attach(
        model, opt, job="bench-stall", sink=sink, queue_size=64, beat_interval_s=0.1
    )
    t0 = time.monotonic()
    for _ in range(STALL_STEPS):
        work.step(model, opt, x, y, rc)
    result = {
        "stall_loop_s": time.monotonic() - t0,
        "still_stalled": time.monotonic() < (sink.stalled_until or 0.0),
        "dropped_during": rc.stats.dropped,
    }
    rc.close()
    result.update(
        dropped_total=rc.stats.dropped, delivered=sink.received, enqueued=rc.stats.enqueued
    )
    return result


def _worker(rank: int, tmp: str, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=WORLD)
    background = {"auto": None, "inline": False, "worker": True}[args.digest]
    plan = {"mlp": (args.steps, args.block), "lm": (args.lm_steps, args.lm_block)}
    try:
        result = {"rank": rank, "workloads": {}}
        for name in args.workloads:
            steps, block = plan[name]
            work = WORKLOADS[name]()
            result["workloads"][name] = _interleaved(
                rank, work, steps, block, background, args.instances
            )
        result.update(_stalled(WORKLOADS["mlp"](), rank))
        out.put(result)
    finally:
        dist.destroy_process_group()


def _print_workload(name: str, rank: int, w: dict) -> None:
    plain = w["plain_us"]
    budget = max(0.01 * plain, 100.0)
    print(f"[{name}] rank {rank}: plain step median {plain:.0f} us, budget {budget:.0f} us")
    for arm in [a for a in ARMS[1:] if a in w]:
        a = w[arm]
        print(
            f"  {arm:10s} median {a['median_us']:.0f} us, ratio {a['median_us'] / plain:.4f}; "
            f"overhead per step: wall {a['pair_over_us']:.0f} +- {a['pair_ci_us']:.0f} us "
            f"(lower quartiles {a['q25_over_us']:.0f}), training thread "
            f"{a['thread_over_us']:.0f} +- {a['thread_ci_us']:.0f} us, "
            f"process CPU {a['cpu_over_us']:.0f} us"
        )
    if "null" in w:
        n = w["null"]
        print(
            f"  noise floor: plain#2 - plain#1 (two identical plain models) wall "
            f"{n['pair_over_us']:.0f} +- {n['pair_ci_us']:.0f} us, training thread "
            f"{n['thread_over_us']:.0f} +- {n['thread_ci_us']:.0f} us"
        )
    total = w["collector"]["thread_over_us"]
    if "hook" in w and "no-digest" in w:
        hook, nodig = w["hook"]["thread_over_us"], w["no-digest"]["thread_over_us"]
        print(
            f"  split (training thread): python hook routing {hook:.0f} us, norms + "
            f"bookkeeping {nodig - hook:.0f} us, digest {total - nodig:.0f} us"
        )
    own = w["self_us"]
    print(
        f"  self-timed (collector code on the training thread, median per step): "
        f"{own['overhead_s']:.0f} us = hooks {own['hooks_s']:.0f} + comm hook "
        f"{own['comm_hook_s']:.0f} (bucket scaling, bookkeeping) + digest "
        f"{own['digest_s']:.0f} (taken over from the worker on "
        f"{w['digest_taken_over']:.0%} of steps, waited for on {w['digest_waited']:.0%}) + "
        f"the loop's own collectives {own['collectives_s']:.0f}; "
        f"apart: local grad-norm pass {own['grad_norm_s']:.0f} us, all-reduce launch "
        f"{own['launch_s']:.0f} us (plain DDP launches it too)"
    )
    direct = own["overhead_s"]
    ab = total - own["grad_norm_s"]  # before/after, without the in-step norm pass
    ci = w["collector"]["thread_ci_us"]
    if direct > budget or ab - ci > budget:
        verdict = "NOT met"
    elif ab + ci <= budget:
        verdict = "MET (self-timed and before/after)"
    else:
        verdict = "MET by self-timing; before/after agrees within its noise"
    print(
        f"  budget {budget:.0f} us: self-timed {direct:.0f} us; before/after on the training "
        f"thread without the norm pass {ab:.0f} +- {ci:.0f} us: {verdict} "
        f"(wall: {w['collector']['pair_over_us']:.0f} +- {w['collector']['pair_ci_us']:.0f} us, "
        f"step ratio {w['collector']['median_us'] / plain:.4f})"
    )
    print(
        f"  alone: one grad-norm pass {w['norm_us']:.0f} us, digest sums "
        f"{w['digest_sums_us']:.0f} us (one read of the parameters); off the training "
        f"thread the sender builds a record in "
        f"{w['record_us']:.0f} us (digest hash {w['digest_hash_us']:.0f} us of it)"
    )


def _print(results: list[dict], args) -> None:
    for name in args.workloads:
        w0 = results[0]["workloads"][name]
        print(
            f"[{name}] CPU DDP, {WORLD} gloo ranks, {w0['describe']}, {w0['params']} "
            f"parameters, {w0['rounds']} rounds x {w0['block']} steps per arm, "
            f"{w0['instances']} model(s) per arm (blocks interleaved, order rotated), "
            f"digest {args.digest}"
        )
        for r in results:
            _print_workload(name, r["rank"], r["workloads"][name])
    for r in results:
        print(
            f"rank {r['rank']}, sink stalled 5 s (mlp): {STALL_STEPS} steps in "
            f"{r['stall_loop_s']:.2f} s, loop done while still stalled: {r['still_stalled']}; "
            f"dropped {r['dropped_during']} during the stall, {r['dropped_total']} in all; "
            f"delivered {r['delivered']} of {r['enqueued']} records"
        )


def _workloads(text: str) -> list[str]:
    if text == "none":  # only the wrapper table
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {unknown or text!r}; choose from {', '.join(WORKLOADS)}"
        )
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="measured MLP steps per arm")
    ap.add_argument("--block", type=int, default=10, help="MLP steps per timed block")
    ap.add_argument("--lm-steps", type=int, default=120, help="measured LM steps per arm")
    ap.add_argument("--lm-block", type=int, default=2, help="LM steps per timed block")
    ap.add_argument("--workloads", type=_workloads, default=["mlp", "lm"], help="mlp,lm or none")
    ap.add_argument(
        "--instances",
        type=int,
        default=2,
        help="identical models per arm kind (>= 2 prints the plain-vs-plain noise floor)",
    )
    ap.add_argument("--wrapper-steps", type=int, default=60, help="LM steps per arm of the "
                    "DDP / FSDP2 / manual all-reduce self-time table (bench/overhead_wrappers.py); "
                    "0 skips it")
    ap.add_argument(
        "--digest",
        choices=("auto", "inline", "worker"),
        default="auto",
        help="where the digest runs: as shipped (auto: inline for CPU parameters), on "
        "the training thread, or on the worker thread (taken over by the training thread "
        "when not started by the next optimizer step)",
    )
    args = ap.parse_args()
    if min(args.steps, args.block, args.lm_steps, args.lm_block, args.instances) < 1:
        ap.error("--steps, --block, --lm-steps, --lm-block and --instances must be >= 1")
    ctx = mp.get_context("spawn")
    if args.workloads:
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_worker, args=(r, tmp, args, out)) for r in range(WORLD)]
            for p in procs:
                p.start()
            results = sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
            for p in procs:
                p.join()
        _print(results, args)
    if args.wrapper_steps:
        from overhead_wrappers import run_wrappers

        run_wrappers(args.wrapper_steps, ctx, WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())

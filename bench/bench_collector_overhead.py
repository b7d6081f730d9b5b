"""What the rank collector costs the training thread, and what a stalled sink costs.

Runs CPU DDP training (2 gloo ranks, a small MLP) and, in ONE run, interleaves
steps of three identical DDP models: one plain, one with the collector, one
with the collector but no parameter digest. Interleaving step by step (order
rotated) cancels machine drift out of the comparison; the overhead is the
median over step pairs of (with - without). Prints, per rank: median step
times, ratios, per-step overhead in microseconds, the same without the local
gradient-norm pass (which the budget excludes), and what the norm pass and
the digest pass take measured alone.

Then attaches a collector whose sink stalls for 5 s in its first send, trains
a fixed number of steps through the stall, and prints how many records were
dropped and whether the loop finished while the sink was still stalled.

    .venv/bin/python bench/bench_collector_overhead.py [--steps 300] [--hidden 256]
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

from collectors import CollectorConfig, RankCollector  # noqa: E402
from collectors.ddp_hook import tensor_norm_stats  # noqa: E402
from collectors.digest import digest_hex, digest_sums  # noqa: E402

WORLD = 2
STALL_STEPS = 300
WARMUP = 20
ARMS = ("plain", "collector", "no-digest")


class NullSink:
    """Accepts and discards: measures the collector, not a disk."""

    def send(self, records):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class StallingSink(NullSink):
    """Blocks in its first send for ``stall_s`` seconds (a hung broker)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.stalled_until: float | None = None
        self.received = 0

    def send(self, records):
        if self.stalled_until is None:
            self.stalled_until = time.monotonic() + self.stall_s
            time.sleep(self.stall_s)
        self.received += len(records)


def _model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def _step(ddp, opt, x, y, rc=None) -> None:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    if rc is not None:
        rc.loss(loss)
    opt.step()


def _time_us(fn, repeat: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def _arm_stats(times: list[float], plain: list[float]) -> dict:
    pairs = [c - p for c, p in zip(times, plain, strict=True)]
    return {
        "median_us": statistics.median(times) * 1e6,
        "pair_over_us": statistics.median(pairs) * 1e6,
        "mean_over_us": (statistics.fmean(times) - statistics.fmean(plain)) * 1e6,
    }


def _interleaved(rank: int, steps: int, hidden: int, batch: int) -> dict:
    DDP = torch.nn.parallel.DistributedDataParallel
    arms = {}
    for name in ARMS:
        model = DDP(_model(hidden))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rc = None
        if name != "plain":
            cfg = CollectorConfig(digest_every_steps=1 if name == "collector" else 0)
            rc = RankCollector.attach(model, opt, job="bench", sink=NullSink(), config=cfg)
        arms[name] = (model, opt, rc, [])
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, hidden, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    for i in range(steps + WARMUP):
        k = i % len(ARMS)  # rotate the order: no arm always runs first
        for name in ARMS[k:] + ARMS[:k]:
            model, opt, rc, times = arms[name]
            t0 = time.perf_counter()
            _step(model, opt, x, y, rc)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
    for _, _, rc, _ in arms.values():
        if rc is not None:
            rc.close()
    plain = arms["plain"][3]
    result = {"plain_us": statistics.median(plain) * 1e6}
    for name in ARMS[1:]:
        result[name] = _arm_stats(arms[name][3], plain)
    params = list(arms["plain"][0].parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    result["params"] = flat.numel()
    result["norm_us"] = _time_us(lambda: tensor_norm_stats(flat))
    result["digest_us"] = _time_us(lambda: digest_hex(digest_sums(params)))
    return result, x, y


def _stalled(hidden: int, x, y) -> dict:
    """A fixed number of steps (every rank must run the same DDP steps) through a stall."""
    model = torch.nn.parallel.DistributedDataParallel(_model(hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = StallingSink(5.0)
    rc = RankCollector.attach(
        model, opt, job="bench-stall", sink=sink, queue_size=64, beat_interval_s=0.1
    )
    t0 = time.monotonic()
    for _ in range(STALL_STEPS):
        _step(model, opt, x, y, rc)
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


def _worker(rank: int, tmp: str, steps: int, hidden: int, batch: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=WORLD)
    try:
        result, x, y = _interleaved(rank, steps, hidden, batch)
        result.update(_stalled(hidden, x, y))
        result["rank"] = rank
        out.put(result)
    finally:
        dist.destroy_process_group()


def _print(results: list[dict], args) -> None:
    print(
        f"CPU DDP, {WORLD} gloo ranks, MLP width {args.hidden}, batch {args.batch}, "
        f"{results[0]['params']} parameters, {args.steps} interleaved steps per arm"
    )
    for r in results:
        budget = max(0.01 * r["plain_us"], 100.0)
        print(f"rank {r['rank']}: plain step median {r['plain_us']:.0f} us, budget {budget:.0f} us")
        for name in ARMS[1:]:
            a = r[name]
            over = a["pair_over_us"]
            print(
                f"  {name:10s} median {a['median_us']:.0f} us, ratio "
                f"{a['median_us'] / r['plain_us']:.4f}, overhead {over:.0f} us/step "
                f"(median of pairs; from means {a['mean_over_us']:.0f}), "
                f"without the grad-norm pass {over - r['norm_us']:.0f} us"
            )
        print(f"  alone: grad-norm pass {r['norm_us']:.0f} us, digest pass {r['digest_us']:.0f} us")
        print(
            f"  sink stalled 5 s: {STALL_STEPS} steps in {r['stall_loop_s']:.2f} s, loop done "
            f"while still stalled: {r['still_stalled']}; dropped {r['dropped_during']} during "
            f"the stall, {r['dropped_total']} in all; delivered {r['delivered']} of "
            f"{r['enqueued']} records"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="measured steps per arm")
    ap.add_argument("--hidden", type=int, default=256, help="MLP width")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, tmp, args.steps, args.hidden, args.batch, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        results = sorted((out.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    _print(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

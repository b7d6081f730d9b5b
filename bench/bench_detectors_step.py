"""Micro-benchmark: every registered detector on one big synthetic job, step by step.

The job is dp x tp x pp = 128 x 8 x 16 (16,384 ranks, 2,048 hosts, 128 peer
groups of 128). Frames are built outside the timed region; the timed region
is what the engine does per step with the detectors: detect with every
spec, build the clean mask, learn. Prints ms per step per detector and in
total, and rank-steps per second. Asserts nothing.

    .venv/bin/python bench/bench_detectors_step.py [--steps 200] [--faults] [--collectives]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rankscope.detectors.registry import DETECTORS, default_configs
from support.synth import layout, make_frame


def _frame(lay, step: int, rng, faults: bool, collectives: bool):
    w = lay["rank"].shape[0]
    stage = 0.20 + 0.01 * lay["pp"]  # stage imbalance: later stages slower
    compute = stage * (1 + 0.02 * rng.standard_normal(w))
    data = 0.002 + 0.0005 * rng.random(w)
    comm = 0.05 + 0.005 * rng.random(w)
    loss = 2.5 + 0.05 * rng.standard_normal(w)
    gnorm = 1.0 + 0.1 * rng.standard_normal(w)
    reduced = (1.0 + 0.001 * lay["group"]).astype(np.float64) * (1 + step * 1e-4)
    digest = [f"{g:08x}-{step:08x}" for g in lay["group"].tolist()]  # distinct str objects
    if faults and step >= 50:
        compute[1234 % w] *= 1.3
        digest[4321 % w] = "corrupt"
    if faults and step == 120:
        gnorm[999 % w] = 3e4
    m = {
        "t": np.full(w, 1.7e9 + step),
        "step_s": compute + data + comm,
        "compute_s": compute,
        "comm_s": comm,
        "data_s": data,
        "loss": loss,
        "grad_norm": gnorm,
        "grad_norm_reduced": reduced,
        "nonfinite": np.zeros(w),
    }
    colls = None
    if collectives:
        colls = [
            [{"op": "allreduce", "group": "dp", "seq": step, "s": float(comm[r])}]
            for r in range(w)
        ]
    return make_frame(lay, step, m, digest=np.array(digest, dtype=object), collectives=colls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (allocation)")
    ap.add_argument("--faults", action="store_true", help="inject a straggler, SDC, spike")
    ap.add_argument("--collectives", action="store_true", help="attach per-rank collectives")
    args = ap.parse_args()
    lay = layout(args.dp, args.tp, args.pp)
    world = lay["rank"].shape[0]
    cfgs = default_configs()
    states = {s.name: s.make_state(cfgs[s.name]) for s in DETECTORS}
    per = {s.name: 0.0 for s in DETECTORS}
    per_cpu = dict(per)
    learn_s = learn_cpu = 0.0
    total = total_cpu = 0.0
    signals = 0
    rng = np.random.default_rng(7)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            per = dict.fromkeys(per, 0.0)
            per_cpu = dict(per)
            learn_s = learn_cpu = total = total_cpu = 0.0
            signals = 0
        frame = _frame(lay, step, rng, args.faults, args.collectives)
        t_step, c_step = time.perf_counter(), time.thread_time()
        named: set[int] = set()
        for spec in DETECTORS:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = spec.detect(frame, states[spec.name], cfgs[spec.name])
            per[spec.name] += time.perf_counter() - t0
            per_cpu[spec.name] += time.thread_time() - c0
            for sig in out.signals:
                named.update(sig.ranks)
            signals += len(out.signals)
        t0, c0 = time.perf_counter(), time.thread_time()
        clean = np.isfinite(frame.m["compute_s"])
        if named:
            clean &= ~np.isin(frame.rank, np.fromiter(named, dtype=np.int64))
        for spec in DETECTORS:
            states[spec.name].learn(frame, clean)
        learn_s += time.perf_counter() - t0
        learn_cpu += time.thread_time() - c0
        total += time.perf_counter() - t_step
        total_cpu += time.thread_time() - c_step
    steps = args.steps
    print(f"job: {world} ranks (dp={args.dp} tp={args.tp} pp={args.pp}), {steps} steps, "
          f"faults={args.faults} collectives={args.collectives}, signals={signals}")
    print(f"  {'':<18} {'wall':>8}  {'cpu':>8}  (ms/step; cpu = this thread's CPU time)")
    for name, sec in per.items():
        print(f"  {name:<18} {sec / steps * 1e3:8.3f}  {per_cpu[name] / steps * 1e3:8.3f}")
    print(f"  {'learn (all)':<18} {learn_s / steps * 1e3:8.3f}  {learn_cpu / steps * 1e3:8.3f}")
    print(f"total wall: {total / steps * 1e3:.3f} ms/step, "
          f"{world * steps / total:,.0f} rank-steps/s")
    print(f"total cpu:  {total_cpu / steps * 1e3:.3f} ms/step, "
          f"{world * steps / total_cpu:,.0f} rank-steps/s "
          "(wall inflates when other processes share the cores; cpu less so)")


if __name__ == "__main__":
    main()

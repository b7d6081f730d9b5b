"""Benchmark: the beat-based hang monitor on a big job.

A 16,384-rank job (tp groups of 8 ranks, 8 dp groups of 2,048, 2,048 hosts) beats once
a second per rank: healthy steps first, then rank 4321 hangs computing and
everyone else blocks in its dp or tp collective. Prints the beat ingest rate,
the cost of ``check`` while healthy (the common case, called after every
batch) and of the stalled ``check`` that builds the wait-for graph, and the
verdict. Asserts nothing.

    .venv/bin/python bench/bench_hang.py [--ranks 16384] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

from rankscope.detectors.hang.monitor import HangMonitor


def beats(world: int, step: int, t: float, culprit: int | None, tp: int = 8):
    out = []
    for r in range(world):
        tpg, dpg = f"tp{r // tp}", f"dp{r % tp}"
        rec = {"type": "beat", "job": "big", "rank": r, "host": f"n{r // 8:04d}", "t": t,
               "step": step, "phase": "collective", "coll_op": "allreduce"}  # fmt: skip
        if culprit is None:
            rec.update(coll_group=dpg, coll_seq=step, coll_done=True)
        elif r == culprit:
            rec.update(phase="backward", coll_group=dpg, coll_seq=step - 1, coll_done=True)
        elif r // tp == culprit // tp:
            rec.update(coll_group=tpg, coll_seq=step, coll_done=False)
        else:
            rec.update(coll_group=dpg, coll_seq=step, coll_done=False)
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    mon = HangMonitor()
    w, t0 = args.ranks, 1.7e9
    tp = 8
    groups = {f"tp{i}": range(i * tp, (i + 1) * tp) for i in range(w // tp)}
    groups |= {f"dp{i}": range(i, w, tp) for i in range(tp)}
    mon.set_job_info("big", world=w, groups=groups)
    batches = [beats(w, s, t0 + s, None) for s in range(args.steps)]
    n, ingest, checks = 0, 0.0, []
    for s, batch in enumerate(batches):
        a = time.perf_counter()
        mon.observe_beats(batch, now=t0 + s)
        ingest += time.perf_counter() - a
        n += len(batch)
        a = time.perf_counter()
        mon.check(t0 + s)
        checks.append(time.perf_counter() - a)
    culprit = min(4321, w - 1)
    stall = [beats(w, args.steps, t0 + args.steps + i, culprit) for i in range(35)]
    found, stalled_check = [], 0.0
    for i, batch in enumerate(stall):
        mon.observe_beats(batch, now=t0 + args.steps + i)
        a = time.perf_counter()
        sig = mon.check(t0 + args.steps + i)
        if sig:
            stalled_check = time.perf_counter() - a
        found += sig
    checks.sort()
    print(f"ranks {w}, healthy steps {args.steps}")
    print(f"beat ingest: {n / ingest:,.0f} beats/s ({ingest / n * 1e6:.2f} us per beat)")
    print(f"check while healthy: median {checks[len(checks) // 2] * 1e3:.2f} ms, "
          f"max {checks[-1] * 1e3:.2f} ms")  # fmt: skip
    print(f"check that localized the stall: {stalled_check * 1e3:.1f} ms")
    print("verdict:", [(s.kind, s.ranks[:8], s.evidence["n_waiting"]) for s in found])


if __name__ == "__main__":
    main()

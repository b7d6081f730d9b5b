"""Engine throughput on a synthetic 16,384-rank job: assembly + detectors, and from Parquet.

Job: 2,048 hosts x 8 ranks, dp x tp x pp = 128 x 8 x 16 (Megatron order: tp
fastest, then dp, then pp), 200 steps, with a 1.3x compute straggler and a
parameter-digest flip injected so the detectors have work to do.

Figures printed:

1. assembly + detectors: rank-steps/s through ``Engine.feed_table`` on
   per-step Arrow tables already in memory (generation is not timed);
2. end to end from Parquet: rank-steps/s for reading a Parquet trace in
   batches, assembling and detecting (``replay_trace``, the CLI's path);
3. peak RSS of each run, measured in a child process per run, at two step
   counts: equal figures show memory does not grow with the number of steps
   (the engine streams over steps).

Targets (issue 3): >= 1,000,000 rank-steps/s for (1), >= 300,000 for (2).
Nothing is asserted; run ``python bench/bench_engine.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DP, TP, PP = 128, 8, 16
WORLD = DP * TP * PP
RANKS_PER_HOST = 8
T0 = 1_764_470_000.0
STRAGGLER = 4_321
FLIPPED = 9_876


def step_table(step: int, rng: np.random.Generator) -> pa.Table:
    """One step of every rank as an Arrow table of ``step`` records."""
    rank = np.arange(WORLD, dtype=np.int64)
    tp, dp, pp = rank % TP, (rank // TP) % DP, rank // (TP * DP)
    compute = 0.8 + 0.05 * pp + 0.01 * rng.standard_normal(WORLD)
    if step >= 20:
        compute[STRAGGLER] *= 1.3
    digest_words = np.array([f"d{step}-{s}" for s in range(TP * PP)] + ["flipped"], dtype=object)
    shard = pp * TP + tp
    if step >= 50:
        shard[FLIPPED] = TP * PP
    hosts = pa.DictionaryArray.from_arrays(
        pa.array(rank // RANKS_PER_HOST, pa.int32()),
        pa.array([f"host{h:04d}" for h in range(WORLD // RANKS_PER_HOST)]),
    )
    return pa.table(
        {
            "v": np.ones(WORLD, np.int64),
            "type": pa.array(["step"] * WORLD),
            "job": pa.array(["bench"] * WORLD),
            "rank": rank,
            "step": np.full(WORLD, step, np.int64),
            "world": np.full(WORLD, WORLD, np.int64),
            "host": hosts.cast(pa.string()),
            "t": T0 + step * 1.0 + 0.001 * rng.random(WORLD),
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "step_s": np.full(WORLD, 1.0),
            "compute_s": compute,
            "comm_s": 0.15 + 0.005 * rng.standard_normal(WORLD),
            "data_s": 0.01 + 0.001 * rng.random(WORLD),
            "loss": 2.0 + 0.01 * rng.standard_normal(WORLD),
            "grad_norm": 1.0 + 0.01 * rng.standard_normal(WORLD),
            "grad_norm_reduced": np.ones(WORLD),
            "nonfinite": np.zeros(WORLD, np.int64),
            "param_digest": pa.array(digest_words[shard]),
        }
    )


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def child_assembly(steps: int) -> dict:
    from rankscope.pipeline.engine.engine import Engine

    rng = np.random.default_rng(0)
    engine = Engine()
    busy = 0.0
    for step in range(steps):
        table = step_table(step, rng)
        t = time.perf_counter()
        engine.feed_table(table)
        busy += time.perf_counter() - t
    t = time.perf_counter()
    engine.flush()
    busy += time.perf_counter() - t
    found = [(f.kind, f.ranks[:3], f.first_step) for f in engine.findings()]
    return {"rank_steps": steps * WORLD, "seconds": busy, "peak_rss_mb": _peak_rss_mb(),
            "findings": found}  # fmt: skip


def write_trace(path: Path, steps: int) -> None:
    rng = np.random.default_rng(0)
    path.mkdir(parents=True, exist_ok=True)
    writer = None
    for step in range(steps):
        table = step_table(step, rng)
        if writer is None:
            writer = pq.ParquetWriter(path / "bench.step.parquet", table.schema)
        writer.write_table(table, row_group_size=WORLD)
    writer.close()


def child_parquet(steps: int, trace: str) -> dict:
    from rankscope.pipeline.offline.replay import replay_trace

    t = time.perf_counter()
    res = replay_trace(trace)
    secs = time.perf_counter() - t
    found = [(f.kind, f.ranks[:3], f.first_step) for f in res.findings]
    return {"rank_steps": steps * WORLD, "seconds": secs, "peak_rss_mb": _peak_rss_mb(),
            "findings": found, "bad": res.report.bad}  # fmt: skip


def _spawn(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, check=True,
                         text=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--child", choices=("assembly", "parquet"))
    ap.add_argument("--trace")
    args = ap.parse_args()
    if args.child == "assembly":
        print(json.dumps(child_assembly(args.steps)))
        return
    if args.child == "parquet":
        print(json.dumps(child_parquet(args.steps, args.trace)))
        return
    print(f"world {WORLD} ranks ({WORLD // RANKS_PER_HOST} hosts), dp x tp x pp = "
          f"{DP} x {TP} x {PP}")  # fmt: skip
    short = max(args.steps // 4, 25)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for steps in (short, args.steps):
            a = _spawn("--child", "assembly", "--steps", str(steps))
            trace = Path(tmp) / f"trace{steps}"
            t = time.perf_counter()
            write_trace(trace, steps)
            mb = sum(f.stat().st_size for f in trace.iterdir()) / 1e6
            print(f"wrote {steps}-step Parquet trace ({mb:.0f} MB) in "
                  f"{time.perf_counter() - t:.1f} s")  # fmt: skip
            p = _spawn("--child", "parquet", "--steps", str(steps), "--trace", str(trace))
            rows.append((steps, a, p))
        for steps, a, p in rows:
            print(f"\n{steps} steps ({steps * WORLD:,} rank-steps)")
            print(f"  assembly + detectors : {a['rank_steps'] / a['seconds']:>12,.0f} rank-steps/s"
                  f"  ({a['seconds']:.2f} s, peak RSS {a['peak_rss_mb']:.0f} MB)")  # fmt: skip
            print(f"  end to end, Parquet  : {p['rank_steps'] / p['seconds']:>12,.0f} rank-steps/s"
                  f"  ({p['seconds']:.2f} s, peak RSS {p['peak_rss_mb']:.0f} MB)")  # fmt: skip
            print(f"  findings: {a['findings']}")
    print("\ntargets: >= 1,000,000 rank-steps/s (assembly + detectors), "
          ">= 300,000 (from Parquet); peak RSS should not grow with steps")


if __name__ == "__main__":
    main()

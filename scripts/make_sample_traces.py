#!/usr/bin/env python3
"""Record sample_traces/: one real simulated run per fault kind plus two clean ones.

Every trace is 8 ranks x 150 steps of real gloo DDP training with the rank
collector attached (``rankscope simulate`` underneath), gzip JSONL, with
labels.jsonl and meta.json; sample_traces/README.md gets a table of what each
holds. Numerics are reproducible from the seeds; timings are not (they are
real), so a regenerated trace differs in its times but not its story.

    .venv/bin/python scripts/make_sample_traces.py            # all of them
    .venv/bin/python scripts/make_sample_traces.py --only hang --only crash
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rankscope.pipeline.simulate import SimConfig, run_simulation  # noqa: E402
from rankscope.pipeline.simulate.model import ModelConfig  # noqa: E402
from rankscope.pipeline.traces.files import read_trace  # noqa: E402

RANKS, STEPS = 8, 150

# name -> (faults, ranks_per_host, topology, seed, what it shows)
TRACES: dict[str, tuple[list[str], int, str | None, int, str]] = {
    "clean-dp8": ([], 4, None, 1, "clean run, 2 hosts x 4 ranks, plain data parallel"),
    "clean-3d": ([], 2, "dp=2,tp=2,pp=2", 2, "clean run, 4 hosts x 2 ranks, dp2 x tp2 x pp2"),
    "straggler-1.6x": (
        ["straggler:rank=5,from=60,factor=1.6"], 4, None, 3,
        "rank 5 computes 1.6x slower from step 60 on (forward and backward)",
    ),
    "straggler-1.25x": (
        ["straggler:rank=1,from=70,factor=1.25"], 4, None, 13,
        "rank 1 computes 1.25x slower from step 70 on: a mild, steady straggler",
    ),
    "straggler-1.25x-backward": (
        ["straggler:rank=2,from=50,until=119,factor=1.25,phase=backward"], 2, "dp=4,tp=2", 4,
        "rank 2's backward is 1.25x slower for steps 50-119: a subtle, backward-only straggler",
    ),
    "network": (
        ["network:rank=6,from=70,until=129,delay_s=0.06"], 4, None, 5,
        "rank 6's all-reduces complete 60 ms late (slow link) for steps 70-129",
    ),
    "sdc-grad": (
        ["sdc-grad:rank=3,from=80,bit=exponent"], 2, "dp=4,tp=2", 6,
        "top exponent bit of one local gradient element flips on rank 3 at step 80",
    ),
    "sdc-param": (
        ["sdc-param:rank=4,from=75"], 4, None, 7,
        "a mantissa bit of one weight flips on rank 4 after step 75: its replica diverges",
    ),
    "sdc-reduce": (
        ["sdc-reduce:rank=1,from=90"], 4, None, 8,
        "rank 1's reduced gradient is corrupted at step 90: its replica diverges",
    ),
    "nonfinite": (
        ["nonfinite:rank=7,from=100"], 4, None, 9,
        "a NaN is born in rank 7's local gradient at step 100 (the step is skipped)",
    ),
    "hang": (
        ["hang:rank=3,from=110"], 2, "dp=4,tp=2", 10,
        "rank 3 blocks forever in forward at step 110; peers wait in the all-reduce",
    ),
    "crash": (
        ["crash:rank=6,from=95"], 4, None, 11,
        "rank 6's process exits in forward at step 95; its peers fail in gloo",
    ),
    "gpu-thermal": (
        ["gpu:rank=5,from=60,mode=thermal,factor=1.5"], 4, None, 12,
        "rank 5's GPU throttles from step 60 (sw_thermal; SM clock and power / 1.5, 84 C) and "
        "its device time stretches 1.5x: scripted NVML under the real GPU collector",
    ),
}


def record(name: str, out_root: Path) -> dict:
    faults, rph, topology, seed, what = TRACES[name]
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    cfg = SimConfig(
        ranks=RANKS, steps=STEPS, out_dir=str(out), faults=faults, ranks_per_host=rph,
        topology=topology, seed=seed, job=f"sample-{name}", gzip=True,
        # a hung job is recorded for longer than the hang monitor's default
        # 30 s stall deadline, so a default replay sees what a live service would
        stall_s=40.0 if any(f.startswith("hang") for f in faults) else 5.0,
    )
    t0 = time.monotonic()
    result = run_simulation(cfg)
    if not result.ok:
        raise SystemExit(f"{name}: ended {result.ended!r}, expected {result.expected_end!r}: "
                         f"{result.errors}")
    trace = read_trace(out)
    counts = Counter(rec["type"] for rec in trace.records)
    steps = {rec["step"] for rec in trace.records if rec["type"] == "step"}
    size = sum(p.stat().st_size for p in out.iterdir())
    row = {
        "name": name, "what": what, "faults": faults, "labels": trace.labels,
        "rph": rph, "topology": cfg.topology, "ended": result.ended,
        "steps": len(steps), "step_records": counts["step"], "beats": counts["beat"],
        "kib": size / 1024, "wall_s": time.monotonic() - t0,
    }
    print(f"{name}: ended {result.ended} in {row['wall_s']:.1f} s, {counts['step']} step + "
          f"{counts['beat']} beat records, {row['kib']:.0f} KiB", flush=True)
    return row


def _label_text(labels: list[dict]) -> str:
    if not labels:
        return "none"
    parts = []
    for lab in labels:
        until = "end" if lab["until"] is None else lab["until"]
        parts.append(f"`{lab['kind']}` ranks {lab['ranks']} hosts {', '.join(lab['hosts'])}, "
                     f"steps {lab['step']}-{until}")
    return "; ".join(parts)


def write_readme(rows: list[dict], out_root: Path) -> None:
    lines = [
        "# Sample traces",
        "",
        "Real traces recorded by `scripts/make_sample_traces.py` with `rankscope simulate`:",
        f"{RANKS} gloo ranks (CPU) training a tiny transformer for {STEPS} steps with the rank",
        "collector attached (file sink, then gzip), faults injected inside the real training.",
        "Each rank also spends emulated device time in proportion to its batch's tokens",
        f"({ModelConfig().device_us_per_token:.0f} us/token forward, twice that backward: ~95% of "
        "`compute_s`, as on a GPU job), so",
        "the relative compute noise is what a GPU job shows (robust sigma ~2%), not the CPU",
        "contention of 8 ranks on 2 cores.",
        "Each directory is one trace: `rank*.jsonl.gz` (records as the collectors wrote them),",
        "`labels.jsonl` (ground truth) and `meta.json` (layout, faults, what each injection did,",
        "how the run ended). Hosts are emulated (`node00`...); coordinates follow tp fastest,",
        "then dp, then pp. Numerics are reproducible from the seeds; timings are real and are",
        "not. See docs/simulate.md for the fault kinds.",
        "",
        "| trace | fault (spec) | label | hosts x ranks, topology | ended | steps | step / beat "
        "records | size |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        topo = "dp{dp} tp{tp} pp{pp}".format(**r["topology"])
        spec = "<br>".join(f"`{f}`" for f in r["faults"]) or "none"
        lines.append(
            f"| `{r['name']}` | {spec}<br>{r['what']} | {_label_text(r['labels'])} | "
            f"{RANKS // r['rph']} x {r['rph']}, {topo} | {r['ended']} | {r['steps']} | "
            f"{r['step_records']} / {r['beats']} | {r['kib']:.0f} KiB |"
        )
    total = sum(r["kib"] for r in rows)
    lines += ["", f"Total: {total:.0f} KiB.", ""]
    (out_root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "sample_traces"))
    ap.add_argument("--only", action="append", choices=sorted(TRACES), default=None)
    args = ap.parse_args(argv)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(TRACES):
        record(name, out_root)
    rows = []  # the README describes every trace present, recorded now or before
    for name in TRACES:
        if (out_root / name / "meta.json").is_file():
            rows.append(_describe(name, out_root))
    write_readme(rows, out_root)
    print(f"wrote {out_root / 'README.md'}")
    return 0


def _describe(name: str, out_root: Path) -> dict:
    faults, rph, _, _, what = TRACES[name]
    out = out_root / name
    trace = read_trace(out)
    meta = trace.meta[0]
    counts = Counter(rec["type"] for rec in trace.records)
    return {
        "name": name, "what": what, "faults": faults, "labels": trace.labels, "rph": rph,
        "topology": meta["topology"], "ended": meta["ended"],
        "steps": len({rec["step"] for rec in trace.records if rec["type"] == "step"}),
        "step_records": counts["step"], "beats": counts["beat"],
        "kib": sum(p.stat().st_size for p in out.iterdir()) / 1024,
    }


if __name__ == "__main__":
    sys.exit(main())

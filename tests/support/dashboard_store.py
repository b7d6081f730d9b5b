"""Real DuckDB stores for the dashboard tests, built by replaying traces.

``build_demo_store`` replays the recorded sample traces in sample_traces/
(real multi-process runs with injected faults) plus one small synthetic trace
written here with ``rankscope.pipeline.traces.files`` that adds what the samples may lack
(GPU records with throttling and an XID on one host, a second job), through
the real `rankscope replay` into a real DuckDB file. Tests then compare what
the dashboard shows with what independent SQL finds in that file.
"""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
from rankscope.collectors.schema.records import GpuRecord, StepRecord
from rankscope.pipeline.cli import main as cli_main
from rankscope.pipeline.traces.files import write_jsonl, write_labels, write_meta
from support.paths import ROOT

__all__ = ["SYNTH_JOB", "SDC_JOB", "write_synthetic_trace", "write_sdc_trace",
           "sample_trace_dirs", "build_demo_store", "shared_demo_store"]

SYNTH_JOB = "synthetic-gpu"
SYNTH_STRAGGLER_RANK = 5
SYNTH_HOT_HOST = "gpuhost1"
SDC_JOB = "synthetic-sdc"
SDC_RANK = 2


def write_synthetic_trace(out: Path, *, steps: int = 60, world: int = 8, per_host: int = 4,
                          job: str = SYNTH_JOB, seed: int = 7) -> Path:
    """An 8-rank data-parallel job whose rank 5 slows down 1.8x from step 20 on,
    while its GPU throttles (sw_thermal, falling SM clock, rising temperature)
    and reports XID 79 once; its peers wait for it, so the job's step grows."""
    rng = random.Random(seed)
    recs = []
    t0 = 1_764_460_000.0
    slow_from = 20
    for s in range(steps):
        t = t0 + s * 0.5
        for r in range(world):
            host = f"gpuhost{r // per_host}"
            slow = r == SYNTH_STRAGGLER_RANK and s >= slow_from
            compute = 0.200 * (1.8 if slow else 1.0) * (1 + rng.gauss(0, 0.01))
            # its peers wait for it (and only once it is slow): the job's step grows
            comm = 0.030 * (1 + rng.gauss(0, 0.02)) + (0.16 if s >= slow_from and not slow else 0.0)
            recs.append(StepRecord(
                job=job, rank=r, step=s, world=world, host=host, t=t, dp=r,
                step_s=compute + comm + 0.01, compute_s=compute, comm_s=comm, data_s=0.01,
                loss=2.0 - 0.01 * s + rng.gauss(0, 0.005),
                grad_norm=1.0 + rng.gauss(0, 0.02), grad_norm_reduced=1.0 + 0.001 * s,
                nonfinite=0, param_digest=f"d{s:05d}",
            ).to_dict())
            throttled = slow
            xid = [79] if (slow and s == slow_from + 5) else None
            recs.append(GpuRecord(
                job=job, host=host, gpu=r % per_host, rank=r, t=t,
                util_pct=97.0, mem_used_mb=30_000.0,
                temp_c=(88.0 + 0.1 * (s - slow_from)) if throttled else 62.0 + rng.gauss(0, 0.3),
                power_w=(310.0 if throttled else 650.0) + rng.gauss(0, 3),
                sm_clock_mhz=1100.0 if throttled else 1980.0,
                clock_events=["sw_thermal", "hw_thermal"] if throttled else [],
                ecc_sbe=0, ecc_dbe=0, xid=xid,
            ).to_dict())
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(recs, out / "records.jsonl.gz")
    write_meta(out, {"job": job, "world": world, "ranks_per_host": per_host,
                     "topology": {"dp": world, "tp": 1, "pp": 1}})
    write_labels(out, [{"kind": "straggler", "ranks": [SYNTH_STRAGGLER_RANK],
                        "hosts": [SYNTH_HOT_HOST], "step": slow_from, "until": None}])
    return out


def write_sdc_trace(out: Path, *, steps: int = 50, world: int = 8, per_host: int = 4,
                    job: str = SDC_JOB, bad_rank: int = SDC_RANK, from_step: int = 30) -> Path:
    """A healthy 8-rank job until rank 2's parameters silently diverge at step 30."""
    rng = random.Random(11)
    recs = []
    t0 = 1_764_470_000.0
    for s in range(steps):
        for r in range(world):
            bad = r == bad_rank and s >= from_step
            recs.append(StepRecord(
                job=job, rank=r, step=s, world=world, host=f"sdchost{r // per_host}",
                t=t0 + s * 0.4, dp=r, step_s=0.3, compute_s=0.2 * (1 + rng.gauss(0, 0.01)),
                comm_s=0.08, data_s=0.01, loss=1.5 + rng.gauss(0, 0.01),
                grad_norm=1.0 + rng.gauss(0, 0.02), grad_norm_reduced=0.9,
                nonfinite=0, param_digest=f"bad{s:05d}" if bad else f"ok{s:05d}",
            ).to_dict())
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(recs, out / "records.jsonl")
    write_meta(out, {"job": job, "world": world, "ranks_per_host": per_host})
    write_labels(out, [{"kind": "sdc", "ranks": [bad_rank], "hosts": ["sdchost0"],
                        "step": from_step, "until": None}])
    return out


def sample_trace_dirs() -> list[Path]:
    """The recorded sample traces (directories with a meta.json or records)."""
    base = ROOT / "sample_traces"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and any(p.glob("*.jsonl*")))


def build_demo_store(tmp: Path) -> tuple[Path, dict]:
    """Replay the sample traces and the synthetic one into ``tmp/demo.duckdb``.

    Returns the path and, read back with plain SQL, ``jobs``, ``findings``
    (count) and ``page_text``: what the front page must carry as text (every
    job with a finding, each in its banner, with its worst finding's kind).
    """
    traces = [*sample_trace_dirs(), write_synthetic_trace(tmp / "synthetic"),
              write_sdc_trace(tmp / "synthetic-sdc")]
    db = tmp / "demo.duckdb"
    rc = cli_main(["replay", *map(str, traces), "--db", str(db)])
    assert rc == 0, f"replay failed with {rc}"
    con = duckdb.connect(str(db), read_only=True)
    try:
        jobs = [r[0] for r in con.execute("SELECT DISTINCT job FROM findings ORDER BY job")
                .fetchall()]
        n = con.execute("SELECT count(*) FROM findings").fetchone()[0]
        worst = con.execute(
            "SELECT job, arg_min(kind, (CASE action WHEN 'evict' THEN 0 WHEN 'recover' THEN 1 "
            "ELSE 2 END, -detected_t)) FROM findings GROUP BY job"
        ).fetchall()
    finally:
        con.close()
    assert n > 0, "the replayed traces produced no findings"
    text = ["Open findings", *sorted({f"{job}: " for job, _ in worst}),
            *sorted({kind for _, kind in worst})]
    return db, {"jobs": jobs, "findings": n, "page_text": text}


_SHARED: dict[str, tuple[Path, dict]] = {}


def shared_demo_store(tmp_path_factory) -> tuple[Path, dict]:
    """``build_demo_store`` once per test session (the replay takes seconds).

    The file is treated as read-only: tests that write copy it first.
    """
    if "demo" not in _SHARED:
        _SHARED["demo"] = build_demo_store(tmp_path_factory.mktemp("dashboard-demo"))
    return _SHARED["demo"]

"""Runs a simulated job: spawns the ranks, watches them, ends the run, writes ground truth.

The ranks are real processes (forkserver with torch preloaded, so eight of
them start in about a second on two cores) meeting at a ``file://``
rendezvous in a fresh temporary directory, so runs never collide on ports.
The parent only watches: each rank reports finished steps, fault injections
and its exit on a small queue. The run ends

- ``completed``: every rank finished every step;
- ``hang``: a hang fault fired and no rank finished a step for ``stall_s``
  seconds since (peers' beats have by then recorded who is blocked where);
  the ranks are asked to stop, then killed; ``stalled``: the same after
  ``progress_timeout_s`` without a hang fault (a loaded machine is slow, not
  hung, so this limit is generous);
- ``crash``/``rank-failed``: a rank exited abnormally; the others get
  ``failure_grace_s`` to fail in gloo on their own, then are stopped;
- ``timeout``: the wall-clock limit passed.

With ``sink="embedded"`` the ranks' collectors put their records on a
multiprocessing queue; a thread in the parent drains it into ``on_record``
(the live stream the service engine consumes) and returns the count.
"""

from __future__ import annotations

import gzip
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.pipeline.simulate.config import SimConfig
from rankscope.pipeline.simulate.faults import fault_class
from rankscope.pipeline.simulate.labels import build_labels, build_meta
from rankscope.pipeline.simulate.spec import host_of
from rankscope.pipeline.simulate.worker import EXIT_STOPPED, WorkerSpec, worker_main

__all__ = ["SimulationResult", "run_simulation"]

_POLL_S = 0.05


@dataclass(slots=True)
class SimulationResult:
    """What happened: how the run ended, and where its trace and ground truth are."""

    ended: str
    expected_end: str
    wall_s: float
    steps_completed: dict[int, int]
    exit_codes: dict[int, int | None]
    labels: list[dict]
    meta: dict
    out_dir: Path | None
    trace_files: list[Path] = field(default_factory=list)
    records_streamed: int = 0
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the run ended the way its faults say it should."""
        return self.ended == self.expected_end

    @property
    def trace_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.trace_files if p.exists())


# Imported once in the fork server, inherited by every rank. DDP's constructor
# imports torch._dynamo (about 3 s of CPU); eight ranks doing that at once on
# two cores took 15-20 s before the first step. A module that fails to import
# here is simply imported later by the rank that needs it.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "rankscope.collectors.rank.collector",
    "pipeline.simulate.worker",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _expected_end(cfg: SimConfig) -> str:
    ends = [fault_class(s.kind).ends_run for s in cfg.faults]
    ends = [e for e in ends if e]
    if "crash" in ends:
        return "crash"
    if "hang" in ends:
        return "hang"
    return "completed"


def _drain_records(q, on_record: Callable[[dict], None] | None, done: threading.Event, counter):
    """Parent-side reader of the embedded channel: batches in, records out.

    Runs on its own thread, so ``on_record`` is called from it, never from the
    caller's; it reads until the ranks are gone and the queue is empty.
    """
    while True:
        try:
            batch = q.get(timeout=0.1)
        except queue_mod.Empty:
            if done.is_set():
                return
            continue
        except (EOFError, OSError, ValueError):  # a killed writer left a torn message
            if done.is_set():
                return
            continue
        recs = batch if isinstance(batch, list) else [batch]
        for rec in recs:
            counter[0] += 1
            if on_record is not None:
                try:
                    on_record(rec)
                except Exception:  # noqa: BLE001 - a consumer bug must not wedge the run
                    import logging

                    logging.getLogger("rankscope.simulate").exception("on_record failed")


class _Watch:
    """Book-keeping of the parent's watch loop."""

    def __init__(self, world: int):
        self.steps = {r: -1 for r in range(world)}
        self.exits: dict[int, tuple[int, str]] = {}
        self.injections: list[dict] = []
        self.last_progress = time.monotonic()
        self.started = False
        self.first_step_t: float | None = None  # monotonic time of the first finished step

    def absorb(self, events) -> None:
        while not events.empty():
            msg = events.get()
            kind, rank = msg[0], msg[1]
            if kind == "step":
                self.steps[rank] = max(self.steps[rank], msg[2])
                self.last_progress = time.monotonic()
                self.started = True
                if self.first_step_t is None:
                    self.first_step_t = self.last_progress
            elif kind == "fault":
                self.injections.append(msg[2])
            elif kind == "exit":
                self.exits.setdefault(rank, (msg[2], msg[3]))


def _stop_all(procs, stop_w, grace_s: float) -> None:
    stop_w.close()  # every rank's watcher sees end-of-file and leaves
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5.0)


def _watch(cfg: SimConfig, procs, events, stop_w, w: _Watch, t0: float) -> str:
    failing_since = None
    failed_end = ""
    while True:
        time.sleep(_POLL_S)
        w.absorb(events)
        now = time.monotonic()
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            if any(c != 0 for c in codes):
                return failed_end or "rank-failed"
            return "completed"
        if failing_since is None and any(c not in (None, 0) for c in codes):
            failing_since = now
            crashed = any(i.get("kind") == "crash" for i in w.injections)
            failed_end = "crash" if crashed else "rank-failed"
        if failing_since is not None and now - failing_since > cfg.failure_grace_s:
            _stop_all(procs, stop_w, cfg.stop_grace_s)
            return failed_end
        hung = any(i.get("kind") == "hang" for i in w.injections)
        limit_s = cfg.stall_s if hung else cfg.progress_timeout_s
        if failing_since is None and w.started and now - w.last_progress > limit_s:
            _stop_all(procs, stop_w, cfg.stop_grace_s)
            return "hang" if hung else "stalled"
        if not w.started and now - t0 > cfg.startup_timeout_s:
            _stop_all(procs, stop_w, cfg.stop_grace_s)
            return "timeout"
        if now - t0 > cfg.timeout_s:
            _stop_all(procs, stop_w, cfg.stop_grace_s)
            return "timeout"


def _compress(out_dir: Path, files: list[Path]) -> list[Path]:
    out = []
    for f in files:
        gz = f.with_name(f.name + ".gz")
        with open(f, "rb") as src, gzip.open(gz, "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        f.unlink()
        out.append(gz)
    return out


def run_simulation(
    cfg: SimConfig, on_record: Callable[[dict], None] | None = None
) -> SimulationResult:
    """Run one simulated job to its end; see the module docstring for how runs end."""
    from rankscope.pipeline.traces.files import write_labels, write_meta

    out_dir = Path(cfg.out_dir) if cfg.out_dir else None
    sink = cfg.sink or f"file://{out_dir}"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    embedded = sink.lower().startswith("embedded")
    ctx = _context()
    events = ctx.SimpleQueue()
    stop_r, stop_w = ctx.Pipe(duplex=False)
    records_q = ctx.Queue() if embedded else None
    channel = None
    if embedded:
        channel = sink.split("://", 1)[1] if "://" in sink else "default"
    rdzv_dir = tempfile.mkdtemp(prefix="rankscope-rdzv-")
    before = set(out_dir.glob("*.jsonl")) if out_dir is not None else set()
    streamed = [0]
    done = threading.Event()
    reader = None
    if embedded:
        reader = threading.Thread(
            target=_drain_records, args=(records_q, on_record, done, streamed), daemon=True
        )
        reader.start()
    procs = []
    t0 = time.monotonic()
    w = _Watch(cfg.ranks)
    try:
        for rank in range(cfg.ranks):
            ws = WorkerSpec(
                rank=rank,
                world=cfg.ranks,
                job=cfg.job,
                host=host_of(rank, cfg.ranks_per_host),
                topology=dict(cfg.topology),
                steps=cfg.steps,
                seed=cfg.seed,
                sink=sink,
                rendezvous=os.path.join(rdzv_dir, "rendezvous"),
                faults=list(cfg.faults),
                model=cfg.model,
                lr=cfg.lr,
                beat_interval_s=cfg.beat_interval_s,
                channel=channel,
            )
            p = ctx.Process(
                target=worker_main,
                args=(ws, events, stop_r, records_q),
                name=f"rankscope-sim-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        stop_r.close()  # the ranks hold their own copies
        ended = _watch(cfg, procs, events, stop_w, w, t0)
    finally:
        stop_w.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        w.absorb(events)
        if reader is not None:
            done.set()
            reader.join(timeout=10.0)
        shutil.rmtree(rdzv_dir, ignore_errors=True)
    wall_s = time.monotonic() - t0
    files: list[Path] = []
    file_dir = Path(sink[7:].split("?")[0]) if sink.startswith("file://") else None
    if out_dir is not None and file_dir == out_dir:
        files = sorted(set(out_dir.glob("*.jsonl")) - before - {out_dir / "labels.jsonl"})
        if cfg.gzip:
            files = _compress(out_dir, files)
    exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
    outcome = {
        "ended": ended,
        "wall_s": round(wall_s, 3),
        "startup_s": None if w.first_step_t is None else round(w.first_step_t - t0, 3),
        "steps_completed": {str(r): s + 1 for r, s in w.steps.items()},
        "exit_codes": {str(r): c for r, c in exit_codes.items()},
        "injections": w.injections,
    }
    labels = build_labels(cfg, w.injections)
    meta = build_meta(cfg, outcome)
    if out_dir is not None:
        write_labels(out_dir, labels)
        write_meta(out_dir, meta)
    errors = {r: msg for r, (code, msg) in w.exits.items() if code not in (0, EXIT_STOPPED)}
    for r, code in exit_codes.items():
        if code not in (0, EXIT_STOPPED) and r not in errors:
            errors[r] = f"exit code {code}" if code is not None else "did not exit"
    return SimulationResult(
        ended=ended,
        expected_end=_expected_end(cfg),
        wall_s=wall_s,
        steps_completed={r: s + 1 for r, s in w.steps.items()},
        exit_codes=exit_codes,
        labels=labels,
        meta=meta,
        out_dir=out_dir,
        trace_files=files,
        records_streamed=streamed[0],
        errors=errors,
    )

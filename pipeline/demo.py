"""The demo job: a faulty 8-rank training run localized live on the embedded bus.

The simulation's ranks are real gloo processes; their collectors send records
over the embedded channel (a multiprocessing queue) to this process, where the
same engine ``rankscope serve`` runs assembles steps on the wall clock, runs
the detectors and writes findings to DuckDB while training is still going.
A copy of the stream is kept as a trace so the run can be replayed offline.
Records from the embedded bus pass the same validation entry as files and
Kafka (``rankscope.pipeline.traces.validate``); refused ones go to
``bad_records`` with their reason.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.collectors.schema.records import RecordError
from rankscope.pipeline.engine.assemble import AssemblerConfig
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.simulate import SimConfig, run_simulation
from rankscope.pipeline.store import Store
from rankscope.pipeline.traces.files import BadLine, write_jsonl
from rankscope.pipeline.traces.validate import check_record

__all__ = ["DemoConfig", "DemoResult", "run_demo", "DEFAULT_FAULTS"]

# One slow GPU-like rank on node01 and one silently corrupted replica on node02.
DEFAULT_FAULTS = (
    "straggler:rank=3,from=50,factor=1.6",
    "sdc-param:rank=5,from=90",
)


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """What the demo runs and where it writes."""

    out_dir: str = "demo_out"
    """Folder for the DuckDB file and the recorded trace."""
    ranks: int = 8
    """World size."""
    ranks_per_host: int = 2
    """Ranks per emulated host."""
    steps: int = 150
    """Optimizer steps."""
    faults: tuple[str, ...] = DEFAULT_FAULTS
    """Fault specs injected into the training (see docs/simulate.md)."""
    job: str = "demo"
    """Job name."""
    poll_s: float = 0.2
    """How often the service loop drains the bus and asks for ready steps."""
    detector_configs: dict = field(default_factory=dict)
    """name -> Config for the engine (``--crash-within``/``--hang-within``: the hang's)."""

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2 for peers to compare, got {self.ranks}")
        if self.steps < 20:
            raise ValueError(f"steps must be >= 20, got {self.steps}")
        if not self.poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")

    @property
    def db_path(self) -> Path:
        return Path(self.out_dir) / "rankscope.duckdb"

    @property
    def trace_dir(self) -> Path:
        return Path(self.out_dir) / "trace"


@dataclass(slots=True)
class DemoResult:
    findings: list[Finding] = field(default_factory=list)
    labels: list[dict] = field(default_factory=list)
    records: int = 0
    bad: int = 0
    wall_s: float = 0.0
    ended: str = ""


def run_demo(cfg: DemoConfig, log=print) -> DemoResult:
    """Run the simulation and the live service side by side; return what was found."""
    cfg.trace_dir.mkdir(parents=True, exist_ok=True)
    if cfg.db_path.exists():  # a demo db is the demo's own: start fresh
        cfg.db_path.unlink()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sim_cfg = SimConfig(
        ranks=cfg.ranks, steps=cfg.steps, ranks_per_host=cfg.ranks_per_host,
        faults=list(cfg.faults), out_dir=str(cfg.trace_dir), sink="embedded://demo",
        job=cfg.job,
    )  # fmt: skip
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["sim"] = run_simulation(sim_cfg, on_record=inbox.put)
        except BaseException as exc:  # noqa: BLE001 - reported by the service loop
            outcome["error"] = exc

    engine = Engine(EngineConfig(assembler=AssemblerConfig(clock="wall")),
                    detector_configs=cfg.detector_configs)  # fmt: skip
    found: dict[str, Finding] = {}
    kept: list[dict] = []
    bad: list[BadLine] = []
    t0 = time.monotonic()
    trainer = threading.Thread(target=train, name="demo-training", daemon=True)
    trainer.start()
    with Store(cfg.db_path) as store:
        while True:
            alive = trainer.is_alive()
            batch = _checked(_drain(inbox), len(kept) + len(bad), bad)
            kept.extend(batch)
            new = engine.feed(batch) if batch else engine.tick()
            _announce(new, found, log)
            store.write_turn(findings=new, scores=engine.drain_scores())
            if not alive and not batch:
                break
            time.sleep(cfg.poll_s)
        _announce(engine.flush(), found, log)
        findings = [f for f in engine.findings() if f.finding_id in found]
        store.write_turn(findings=findings, scores=engine.drain_scores(True),
                         jobs=[engine.job_summary(j) for j in engine.jobs],
                         source="embedded://demo")  # fmt: skip
        store.record_bad("embedded://demo", bad)
    if "error" in outcome:
        raise outcome["error"]
    sim = outcome["sim"]
    write_jsonl(kept, cfg.trace_dir / "records.jsonl.gz")
    return DemoResult(findings=findings, labels=sim.labels, records=len(kept), bad=len(bad),
                      wall_s=time.monotonic() - t0, ended=sim.ended)  # fmt: skip


def _checked(batch: list, seen: int, bad: list[BadLine]) -> list[dict]:
    """The records of ``batch`` the validation entry accepts; the others into ``bad``
    (numbered by arrival, ``seen`` records before this batch)."""
    out = []
    for i, rec in enumerate(batch):
        try:
            out.append(check_record(rec))
        except RecordError as exc:
            bad.append(BadLine("embedded://demo", seen + i + 1, str(exc)))
    return out


def _drain(inbox: queue.SimpleQueue, limit: int = 50_000) -> list[dict]:
    out = []
    while len(out) < limit:
        try:
            out.append(inbox.get_nowait())
        except queue.Empty:
            break
    return out


def _announce(new: list[Finding], seen: dict[str, Finding], log) -> None:
    for f in new:
        if f.finding_id not in seen:
            log(f"  live: {f.kind} on rank(s) {list(f.ranks)} host(s) {list(f.hosts)} "
                f"from step {f.first_step} (detected at step {f.detected_step}) -> {f.action}")
        seen[f.finding_id] = f


"""The engine: records of many jobs in, findings out; the same code online and in replay.

One ``Engine`` serves any number of jobs. For every job it keeps a step
assembler buffer, one state per registered detector, an incident tracker,
a score accumulator and (when a factory is given) a beat monitor for hangs.

For each assembled step it runs every detector of ``detectors.registry``,
builds ``clean_mask`` (rows named by no signal of the step and with finite
readings), lets every detector state learn from the clean rows only, folds
the step's signals into incidents and returns the findings that are new or
changed. Use:

    engine = Engine()                       # replay: record clock
    changed = engine.feed(records)          # validated dicts of any type
    changed += engine.feed_columns(job, steps, chunk)  # step records as columns
    changed += engine.feed_table(table)     # Arrow table of step records
    changed += engine.tick()                # deadlines and hang checks
    changed += engine.flush()               # end of stream
    rows = engine.drain_scores()            # heatmap rows for the store

Online (``serve``), construct with ``EngineConfig(assembler=AssemblerConfig(
clock="event"))`` and pass ``now=time.time()``: steps and hang checks then go by
the jobs' event-time watermarks, so a stream in any arrival order gives what
replay gives (``rankscope.pipeline.engine.watermark``).

Beat monitors (``registry.BEAT_DETECTORS``, the hang monitor) plug in through
``beat_monitor_factory`` (``job -> monitor``); a monitor gets the job's ``beat`` records through
``observe_beats(beats, now=...)`` (``now`` is the wall clock online, None in
replay: the beats' own ``t`` then), every assembled step through ``observe_frame(frame)``
and is asked ``check(now) -> list[Signal]`` after every feed and tick, with
``now`` the job's clock (record time in replay). Its signals become findings
like any detector's; a signal may name its step in ``evidence["step"]``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.registry import BEAT_DETECTORS, DETECTORS, default_configs
from rankscope.detectors.registry import beat_monitor_factory as registered_beat_monitors
from rankscope.detectors.signal import Signal
from rankscope.detectors.stats.consensus import step_reference_s
from rankscope.pipeline.engine.assemble import AssemblerConfig, StepAssembler
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.engine.incidents import IncidentTracker
from rankscope.pipeline.engine.policy import PolicyConfig
from rankscope.pipeline.engine.scores import ScoreBuckets
from rankscope.pipeline.engine.step_buffers import loss_counts

__all__ = ["Engine", "EngineConfig", "BeatMonitor", "clean_mask"]

log = logging.getLogger(__name__)


class BeatMonitor(Protocol):
    """What the engine needs from a hang monitor (one per job)."""

    def observe_beats(self, beats: list[dict], now: float | None = None) -> object: ...
    def observe_frame(self, frame: StepFrame) -> None: ...
    def check(self, now: float) -> list[Signal]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, d: dict) -> None: ...


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How steps are assembled, incidents merged and actions chosen."""

    assembler: AssemblerConfig = field(default_factory=AssemblerConfig)
    """Step completion and clock (``record`` for replay, ``wall`` online)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Severity and duration -> evict / recover / observe."""
    merge_gap_steps: int = 2
    """A signal within this many steps of an incident's last step continues it."""
    reopen_gap_steps: int = 16
    """A slowness signal on the same ranks whose onset is within this many steps of a
    closed incident's last step reopens it (hysteresis: a mild straggler on a noisy host
    drops below its thresholds for a few steps and is still one finding)."""
    report_transient: bool = False
    """Also report unconfirmed transient deviations as findings (they always reach scores)."""
    score_cells_per_step: int = 1024
    """Heatmap budget: stored score cells per step on average (see pipeline/engine/scores.py)."""
    strict: bool = False
    """Raise detector exceptions instead of counting and logging them (tests)."""
    hang_monitor: bool = True
    """Watch beats with the registered beat detector (``registry.BEAT_DETECTORS``: hangs
    and crashed ranks) when no ``beat_monitor_factory`` is given."""

    def __post_init__(self) -> None:
        if self.merge_gap_steps < 1:
            raise ValueError(f"merge_gap_steps must be >= 1, got {self.merge_gap_steps}")
        if self.reopen_gap_steps < self.merge_gap_steps:
            raise ValueError("reopen_gap_steps must be >= merge_gap_steps")
        if self.score_cells_per_step < 1:
            raise ValueError(f"score_cells_per_step must be >= 1, got {self.score_cells_per_step}")


def clean_mask(frame: StepFrame, signals: list[Signal]) -> np.ndarray:
    """Rows that may teach baselines: named by no signal, every reported reading finite.

    A column counts for a row when some row of its peer group reports it, so a
    rank that lost a reading its peers have (NaN) is not clean; a column its
    group does not report is ignored (under pipelining only the last stage
    reports ``loss`` and only the first ``tokens``: each stage still learns).
    ``nonfinite > 0`` is never clean.
    """
    named = [r for s in signals for r in s.ranks]
    clean = ~np.isin(frame.rank, np.asarray(named, dtype=np.int64)) if named else np.ones(
        frame.n, dtype=bool
    )
    group = None
    for name, col in frame.m.items():
        if name in ("t", "dropped", "nonfinite_named"):
            continue
        fin = np.isfinite(col)
        if fin.all() or not fin.any():
            continue
        if group is None:
            group = np.asarray(frame.group, dtype=np.int64)
        reported = np.bincount(group, weights=fin) > 0  # per group: some row has it
        clean &= fin | ~reported[group]
    nonfinite = frame.m.get("nonfinite")
    if nonfinite is not None:
        with np.errstate(invalid="ignore"):
            clean &= ~(nonfinite > 0)
    return clean


def _signal_hosts(assembler, job: str, sig: Signal):
    """Hosts from the step records, else the host a hang signal's evidence names
    (a rank known only from its beats, e.g. an imported Flight Recorder trace)."""
    described = (sig.evidence or {}).get("ranks") or {}

    def hosts_of(ranks: list[int]) -> list[str]:
        known = assembler.hosts_of(job, ranks)
        return [
            h if h != "?" else ((described.get(str(r)) or {}).get("host") or "?")
            for r, h in zip(ranks, known, strict=True)
        ]

    return hosts_of


class _JobRun:
    __slots__ = ("states", "incidents", "scores", "monitor", "frames", "errors", "last_step",
                 "held_beats")  # fmt: skip

    def __init__(self, job, cfgs, cfg: EngineConfig, monitor, job_hosts=None) -> None:
        self.states = {spec.name: spec.make_state(cfgs[spec.name]) for spec in DETECTORS}
        self.incidents = IncidentTracker(
            job,
            cfg.policy,
            merge_gap_steps=cfg.merge_gap_steps,
            reopen_gap_steps=cfg.reopen_gap_steps,
            report_transient=cfg.report_transient,
            job_hosts=job_hosts,
        )
        self.scores = ScoreBuckets(job, cfg.score_cells_per_step)
        self.monitor = monitor
        self.held_beats: list[dict] = []  # event clock: beats past the watermark wait here
        self.frames = 0
        self.errors: Counter = Counter()
        self.last_step: int | None = None


class Engine:
    """Assembles steps, runs the detectors, merges incidents; many jobs at once."""

    def __init__(
        self,
        cfg: EngineConfig | None = None,
        *,
        detector_configs: dict[str, Any] | None = None,
        beat_monitor_factory: Callable[[str], BeatMonitor] | None = None,
    ) -> None:
        self.cfg = cfg or EngineConfig()
        self.detector_configs = {**default_configs(), **(detector_configs or {})}
        self.assembler = StepAssembler(self.cfg.assembler)
        self.beat_monitor_factory = beat_monitor_factory
        if beat_monitor_factory is None and self.cfg.hang_monitor:
            beat_cfg = self.detector_configs.get(BEAT_DETECTORS[0].name)  # None: defaults
            self.beat_monitor_factory = registered_beat_monitors(
                self.cfg.assembler.clock == "wall", beat_cfg)  # fmt: skip
        self._final = False  # flush: the monitor checks at the job's latest time
        self._runs: dict[str, _JobRun] = {}
        self._restored: dict[str, dict] = {}

    # -- per job -----------------------------------------------------------
    def _run(self, job: str) -> _JobRun:
        run = self._runs.get(job)
        if run is None:
            monitor = self.beat_monitor_factory(job) if self.beat_monitor_factory else None
            run = self._runs[job] = _JobRun(
                job, self.detector_configs, self.cfg, monitor, lambda: self._job_hosts(job)
            )
            saved = self._restored.pop(job, None)
            if saved is not None:
                self._load_run(run, saved)
        return run

    # -- input -------------------------------------------------------------
    def feed(self, records: list[dict], now: float | None = None) -> list[Finding]:
        """Take validated records of any type; return findings new or changed by them."""
        now = self._now(now)
        if self.beat_monitor_factory is not None and "beat" in set(
            map(dict.get, records, repeat("type"))
        ):
            beats: dict[str, list[dict]] = {}
            for rec in records:
                if rec.get("type") == "beat":
                    beats.setdefault(rec["job"], []).append(rec)
            wall = now if self.cfg.assembler.clock == "wall" else None
            event = self.cfg.assembler.clock == "event"
            for job, bs in beats.items():
                run = self._run(job)
                if run.monitor is None:
                    continue
                if event:  # shown to the monitor once the watermark has passed them
                    run.held_beats.extend(bs)
                elif run.monitor is not None:
                    run.monitor.observe_beats(bs, now=wall)
        self.assembler.add_records(records, now)
        return self.tick(now)

    def feed_columns(self, job: str, step: np.ndarray, chunk: dict[str, np.ndarray],
                     now: float | None = None) -> list[Finding]:  # fmt: skip
        """Take valid ``step`` records of one job as columns (``bus_decode.StepBatch``:
        what ``serve`` decodes a batched message into); return findings new or changed."""
        now = self._now(now)
        self.assembler.add_columns(job, step, chunk, now)
        return self.tick(now)

    def feed_table(self, table, now: float | None = None) -> tuple[list[Finding], list]:
        """Take an Arrow table of ``step`` records (columnar path, no per-record Python).

        Returns ``(findings, refused)`` where ``refused`` lists ``(row, reason)``
        of rows that break the schema. Raises ``ValueError`` for an unusable table.
        """
        now = self._now(now)
        refused = self.assembler.add_table(table, now)
        return self.tick(now), refused

    def tick(self, now: float | None = None) -> list[Finding]:
        """Build the steps whose time has come and ask the hang monitors; online, call often."""
        now = self._now(now)
        out: dict[str, Finding] = {}
        for frame in self.assembler.ready(now):
            for f in self._process(frame, now):
                out[f.finding_id] = f
        if self.beat_monitor_factory is not None:
            for job in list(self._runs):
                for f in self._check_monitor(job, now):
                    out[f.finding_id] = f
        return list(out.values())

    def flush(self) -> list[Finding]:
        """End of stream: build every open step, final hang check (replay: with the
        end-of-trace stall deadline, ``HangMonitor.check_end``)."""
        now = self._now(None)
        out: dict[str, Finding] = {}
        for frame in self.assembler.flush():
            for f in self._process(frame, now):
                out[f.finding_id] = f
        if self.beat_monitor_factory is not None:
            self._final = True  # end of stream: everything has come, the watermark is moot
            # replay: the end of the trace is the end of the job; a live service that
            # stops (wall or event clock) says nothing about its jobs
            end = self.cfg.assembler.clock == "record"
            try:
                for job in list(self._runs):
                    for f in self._check_monitor(job, now, end=end):
                        out[f.finding_id] = f
            finally:
                self._final = False
        return list(out.values())

    def _now(self, now: float | None) -> float | None:
        if now is None and self.cfg.assembler.clock != "record":
            return time.time()
        return now

    # -- one step ----------------------------------------------------------
    def process_frame(self, frame: StepFrame, now: float | None = None) -> list[Finding]:
        """Run detectors on an already assembled frame (what ``tick`` does per step)."""
        return self._process(frame, now)

    def _process(self, frame: StepFrame, now: float | None) -> list[Finding]:
        run = self._run(frame.job)
        signals: list[Signal] = []
        scores: dict[str, np.ndarray] = {}
        for spec in DETECTORS:
            try:
                res = spec.detect(frame, run.states[spec.name], self.detector_configs[spec.name])
            except Exception:
                self._fail(run, spec.name, "detect", frame)
                continue
            signals.extend(res.signals)
            for metric, arr in (res.scores or {}).items():
                prev = scores.get(metric)
                if prev is None:
                    scores[metric] = arr
                else:  # two detectors scoring one metric: keep the larger deviation
                    with np.errstate(invalid="ignore"):
                        scores[metric] = np.where(np.abs(arr) > np.abs(prev), arr, prev)
        clean = clean_mask(frame, signals)
        for spec in DETECTORS:
            try:
                run.states[spec.name].learn(frame, clean)
            except Exception:
                self._fail(run, spec.name, "learn", frame)
        if run.monitor is not None:
            run.monitor.observe_frame(frame)
        run.frames += 1
        run.last_step = frame.step
        run.scores.add(frame.step, frame.world, frame.rank, scores)
        t = self._event_time(frame.job, frame.t, now)
        return run.incidents.update(
            frame.step, t, signals, self._hosts_fn(frame), step_s=step_reference_s(frame)
        )

    def _fail(self, run: _JobRun, name: str, what: str, frame: StepFrame) -> None:
        if self.cfg.strict:
            raise
        run.errors[f"{name}.{what}"] += 1
        if run.errors[f"{name}.{what}"] == 1:
            log.exception("detector %s failed in %s at %s step %d", name, what, frame.job,
                          frame.step)  # fmt: skip

    def _hosts_fn(self, frame: StepFrame):
        def hosts_of(ranks: list[int]) -> list[str]:
            out = []
            for r in ranks:
                i = _row_of(frame.rank, r)
                out.append(str(frame.host[i]) if i is not None else self.assembler.hosts_of(
                    frame.job, [r])[0])  # fmt: skip
            return out

        return hosts_of

    def _event_time(self, job: str, record_t: float, now: float | None) -> float:
        if self.cfg.assembler.clock == "wall" and now is not None:
            return float(now)
        if math.isfinite(record_t):
            return float(record_t)
        return self.assembler.clock(job)

    def _check_monitor(self, job: str, now: float | None, end: bool = False) -> list[Finding]:
        """Ask the job's beat monitor; ``end``: the stream ended (replay: the trace did),
        so a monitor that has ``check_end`` judges a stall by its end-of-trace deadline."""
        run = self._runs[job]
        if run.monitor is None:
            return []
        at = now if self.cfg.assembler.clock == "wall" and now is not None else None
        if at is None:
            event = self.cfg.assembler.clock == "event" and now is not None and not self._final
            at = self.assembler.watermark(job, now) if event else self.assembler.clock(job)
        if run.held_beats:
            self._release_beats(run, at if math.isfinite(at) else -math.inf)
        if not math.isfinite(at):
            return []
        try:
            check = getattr(run.monitor, "check_end", None) if end else None
            signals = (check or run.monitor.check)(at)
        except Exception:
            if self.cfg.strict:
                raise
            run.errors["beat_monitor.check"] += 1
            log.exception("beat monitor failed for job %s", job)
            return []
        out = []
        default_step = (run.last_step + 1) if run.last_step is not None else 0
        for sig in signals:
            step = (sig.evidence or {}).get("step", default_step)
            step = int(step) if isinstance(step, int | float) and step == step else default_step
            out.extend(
                run.incidents.update(step, at, [sig], _signal_hosts(self.assembler, job, sig))
            )
        return out

    @staticmethod
    def _release_beats(run: _JobRun, upto: float) -> None:
        """Event clock: beats up to the watermark to the monitor, in time order (a rank
        whose beats are still on their way must not look silent beside its peers')."""
        held = sorted(run.held_beats, key=lambda b: b.get("t", -math.inf))
        cut = len(held)
        while cut and held[cut - 1].get("t", -math.inf) > upto:
            cut -= 1
        run.held_beats = held[cut:]
        if cut:
            run.monitor.observe_beats(held[:cut], now=None)

    # -- results -----------------------------------------------------------
    @property
    def jobs(self) -> list[str]:
        return sorted(set(self._runs) | set(self.assembler.jobs))

    def findings(self, job: str | None = None) -> list[Finding]:
        """Every finding so far (open and closed), latest version, ordered by step."""
        runs = [self._runs[job]] if job in self._runs else ([] if job else self._runs.values())
        out = [f for r in runs for f in r.incidents.findings.values()]
        return sorted(out, key=lambda f: (f.job, f.first_step, f.kind, f.ranks, f.detector))

    def drain_scores(self, final: bool = False) -> list[dict[str, np.ndarray]]:
        """Heatmap rows of finished score buckets, one column dict per job (see scores.py)."""
        out = []
        for run in self._runs.values():
            rows = run.scores.drain(final)
            if rows is not None:
                out.append(rows)
        return out

    def stats(self, job: str) -> dict[str, int]:
        """Assembly counters plus frames built and detector errors for one job."""
        out = dict(self.assembler.stats(job))
        run = self._runs.get(job)
        if run is not None:
            out["detected_frames"] = run.frames
            out["open_incidents"] = run.incidents.open_count()
            out["findings"] = len(run.incidents.findings)
            for k, v in run.errors.items():
                out[f"error.{k}"] = v
        return out

    def _job_hosts(self, job: str) -> set[str]:
        hosts = set(self.assembler.hosts_of(job, range(self.assembler.world(job))))
        hosts.discard("?")
        return hosts

    def job_summary(self, job: str) -> dict:
        """What the store's ``jobs`` table holds for one job."""
        run = self._runs.get(job)
        hosts = {h for h in self.assembler.hosts_of(job, range(self.assembler.world(job)))}
        hosts.discard("?")
        st = self.assembler.stats(job)
        return {
            "job": job,
            "world": self.assembler.world(job),
            "hosts": len(hosts),
            "last_step": run.last_step if run else None,
            "frames": run.frames if run else 0,
            "last_t": self.assembler.clock(job),
            **loss_counts(st),
        }

    # -- persistence -------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume after a restart (JSON-safe if the detectors' are)."""
        return {
            "assembler": self.assembler.state_dict(),
            "jobs": {
                job: {
                    "detectors": {n: s.state_dict() for n, s in run.states.items()},
                    "incidents": run.incidents.state_dict(),
                    "monitor": run.monitor.state_dict() if run.monitor is not None else None,
                    "last_step": run.last_step,
                    "frames": run.frames,
                    "scores": run.scores.state_dict(),
                }
                for job, run in self._runs.items()
            },
        }

    def load_state_dict(self, d: dict) -> None:
        self.assembler.load_state_dict(d.get("assembler", {}))
        for job, saved in d.get("jobs", {}).items():
            if job in self._runs:
                self._load_run(self._runs[job], saved)
            else:
                self._restored[job] = saved

    @staticmethod
    def _load_run(run: _JobRun, saved: dict) -> None:
        for name, sd in saved.get("detectors", {}).items():
            if name in run.states:
                run.states[name].load_state_dict(sd)
        run.incidents.load_state_dict(saved.get("incidents", {}))
        if run.monitor is not None and saved.get("monitor") is not None:
            run.monitor.load_state_dict(saved["monitor"])
        run.last_step = saved.get("last_step")
        run.frames = int(saved.get("frames", 0))
        if saved.get("scores"):
            run.scores.load_state_dict(saved["scores"])


def _row_of(rank: np.ndarray, r: int) -> int | None:
    i = int(np.searchsorted(rank, r))
    return i if i < rank.size and int(rank[i]) == r else None

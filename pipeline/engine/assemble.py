"""Step assembly: records of many jobs in, whole steps (``StepFrame``) out.

Records are grouped per (job, step). A step is complete when every rank of
the world has reported, or when its deadline has passed: the deadline is
``max(deadline_factor x median recent step time, deadline_floor_s)``,
measured from the moment the step's first record arrived. Ranks that did not
report by then become ``frame.missing`` (absence is evidence too).

Clocks: ``record`` (replay): the job's latest ``step``/``check`` time ``t`` (beats
and GPU samples may run on skewed clocks, so they expire no step); ``event``
(``serve``): the job's watermark (``watermark.py``), the wall clock only saying
when a silent rank stops being waited for; ``wall``: the wall clock from arrival.

Robustness: duplicates collapse (the last record of a rank wins), records
may arrive in any order (frames still come out in step order per job), a
record for a step already emitted is counted as late and dropped (the step's
detectors have run), and ranks outside ``0..world-1`` are refused; so are
steps and times too far ahead of the job (``job_bounds``) and records of a
world the job's ranks did not vote for (``world_vote``).

Two input paths share the buffers: ``add_records`` for online dicts and
``add_table`` for Arrow/Parquet batches (per-step column chunks cut with whole
array operations, no per-record Python). GPU samples are joined onto frames
by ``GpuJoin``; ``beat`` records are not handled here (the engine routes them
to the hang monitor).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter

import numpy as np
from rankscope.detectors.frame import StepFrame
from rankscope.pipeline.engine.columns import build_frame, split_step_table
from rankscope.pipeline.engine.job_bounds import far_ahead, t_ahead, t_far, too_many_far
from rankscope.pipeline.engine.step_buffers import JobBuffer, Pending
from rankscope.pipeline.engine.world_vote import keep_world
from rankscope.pipeline.traces.validate import DEFAULT_MAX_WORLD

__all__ = ["AssemblerConfig", "StepAssembler"]

CLOCKS = ("record", "event", "wall")
log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AssemblerConfig:
    """When a step counts as complete."""

    clock: str = "record"
    """``record``: the latest record ``t`` of the job (replay); ``event``: the job's
    watermark (online); ``wall``: caller's now."""
    deadline_factor: float = 3.0
    """A step is overdue after this many median recent step times..."""
    deadline_floor_s: float = 2.0
    """...but never sooner than this many seconds (absorbs bus and clock jitter)."""
    initial_deadline_s: float = 30.0
    """Deadline before any step time of the job is known."""
    recent_steps: int = 16
    """How many recent steps the median step time is taken over."""
    max_pending_steps: int = 64
    """More open steps than this and the oldest is built at once (bounds memory)."""
    max_world: int = DEFAULT_MAX_WORLD
    """Records claiming a larger world are refused (a corrupt record must not allocate GBs)."""
    max_step_ahead: int = 100_000
    """A step further than this past the job's current step is held to a majority of its ranks."""
    max_t_ahead_s: float = 7 * 86_400.0
    """A record whose ``t`` is further than this past the job's clock is refused."""
    stall_s: float = 5.0
    """(``event``) Wall seconds without a record before a rank stops holding the watermark."""

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        for name in ("deadline_factor", "deadline_floor_s", "initial_deadline_s", "stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.recent_steps < 1:
            raise ValueError(f"recent_steps must be >= 1, got {self.recent_steps}")
        if self.max_pending_steps < 1:
            raise ValueError(f"max_pending_steps must be >= 1, got {self.max_pending_steps}")
        if self.max_world < 1:
            raise ValueError(f"max_world must be >= 1, got {self.max_world}")
        if self.max_step_ahead < 1:
            raise ValueError(f"max_step_ahead must be >= 1, got {self.max_step_ahead}")
        if not self.max_t_ahead_s > 0:
            raise ValueError(f"max_t_ahead_s must be > 0, got {self.max_t_ahead_s}")


class StepAssembler:
    """Groups records per (job, step) and hands out complete or overdue steps in order.

    Typical use: ``add_records(recs)`` / ``add_table(tbl)`` as input comes,
    then ``ready(now)`` for the frames that can be built; ``flush()`` at the
    end of a stream builds everything still open.
    """

    def __init__(self, cfg: AssemblerConfig | None = None) -> None:
        self.cfg = cfg or AssemblerConfig()
        self._jobs: dict[str, JobBuffer] = {}
        self._decode_cache: dict = {}

    # -- input -------------------------------------------------------------
    def _job(self, name: str) -> JobBuffer:
        j = self._jobs.get(name)
        if j is None:
            j = self._jobs[name] = JobBuffer(name, self.cfg.recent_steps)
        return j

    def _pending(self, j: JobBuffer, step: int, now: float, n: int = 1) -> Pending | None:
        """The open step ``step`` of ``j`` (opened when new); None, with its ``n`` records
        counted as late, when the step is built already."""
        if j.last_emitted is not None and step <= j.last_emitted:
            j.stats["late"] += n
            return None
        p = j.pending.get(step)
        if p is None:
            if too_many_far(j, step, self.cfg.max_step_ahead):
                j.stats["ahead"] += n
                return None
            p = j.pending[step] = Pending(step, now, j.world)
        return p

    def add_records(self, recs: list[dict], now: float | None = None) -> None:
        """Take validated records; ``step``, ``check`` and ``gpu`` are kept, any ``t`` advances
        the job's record clock. ``now``: wall clock (``wall`` mode; default time.time())."""
        wall = self.cfg.clock == "wall"
        event = self.cfg.clock == "event"
        if (wall or event) and now is None:
            now = time.time()
        if recs and self._add_step_run(recs, now, wall):
            return
        j = p = None
        job = step = None
        max_world = self.cfg.max_world
        for rec in recs:
            kind = rec.get("type")
            if rec["job"] != job:  # records of one job and step come in runs: cache lookups
                job = rec["job"]
                j = self._job(job)
                step = p = None
            if rec.get("dropped"):  # what the collector could not send: loss made visible
                j.stats["dropped"] += int(rec["dropped"])
            t = rec.get("t")
            if t_ahead(j, t, self.cfg.max_t_ahead_s):
                j.stats["t_ahead"] += 1
                continue
            if t is not None and t > j.clock:
                j.clock = float(t)
            if kind == "step":
                if t is not None and t > j.step_clock:
                    j.step_clock = float(t)
                world, rank = int(rec["world"]), int(rec["rank"])
                if not 0 <= rank < world or world > max_world:
                    j.stats["refused"] += 1
                    continue
                if not j.vote.agrees(world):
                    if not j.vote.add(world, (rank,)):
                        j.stats["world_mismatch"] += 1
                        continue
                    j.world = j.vote.world
                if event:
                    j.mark.rank(rank, t, now, step=True)
                if rec["step"] != step or p is None:
                    step = rec["step"]
                    p = self._pending(j, int(step), now if wall else j.step_clock)
                    if p is None:
                        continue
                if len(p.flags) < world:
                    p.grow(world)
                if p.flags[rank]:
                    j.stats["duplicates"] += 1
                else:
                    p.flags[rank] = 1
                    p.count += 1
                if t is not None and t > p.t_hi:
                    p.t_hi = t
                p.recs.append(rec)
                j.stats["records"] += 1
            elif kind == "check":
                if t is not None and t > j.step_clock:
                    j.step_clock = float(t)
                if event and isinstance(rec.get("rank"), int):
                    j.mark.rank(rec["rank"], t, now, step=True)
                c = self._pending(j, int(rec["step"]), now if wall else j.step_clock)
                if c is not None:
                    c.checks.append(rec)
            elif kind == "gpu":
                j.gpu.observe(rec)
                if event:
                    j.mark.gpu_sample((rec.get("host"), rec.get("gpu"), rec.get("rank")), t, now)
            elif event and kind == "beat" and isinstance(rec.get("rank"), int):
                j.mark.rank(rec["rank"], t, now, step=False)

    def _add_step_run(self, recs: list[dict], now: float | None, wall: bool) -> bool:
        """``add_records`` for the common batch, ``step`` records of one job, with whole-array
        operations: the same counters, clocks, marks and record order as the record loop.

        Returns False (nothing changed) for any other batch; the loop takes it then.
        """
        if set(map(dict.get, recs, repeat("type"))) != {"step"}:
            return False
        if len(set(map(itemgetter("job"), recs))) != 1:
            return False
        n = len(recs)
        dropped = sum(filter(None, map(dict.get, recs, repeat("dropped"))))
        try:
            t = np.array(list(map(dict.get, recs, repeat("t"))), dtype=np.float64)
            rank = np.fromiter(map(itemgetter("rank"), recs), np.int64, n)
            world = np.fromiter(map(itemgetter("world"), recs), np.int64, n)
            step = np.fromiter(map(itemgetter("step"), recs), np.int64, n)
        except (KeyError, TypeError, ValueError, OverflowError):
            return False
        if t.ndim != 1:
            return False

        def put(p: Pending, a: int, b: int, idx: np.ndarray, whole: bool) -> None:
            p.recs.extend(recs[a:b] if whole else [recs[i] for i in idx.tolist()])

        j = self._job(recs[0]["job"])
        if dropped:
            j.stats["dropped"] += int(dropped)
        self._add_runs(j, t, rank, world, step, now, wall, put)
        return True

    def add_columns(self, job: str, step: np.ndarray, chunk: dict[str, np.ndarray],
                    now: float | None = None) -> None:  # fmt: skip
        """Take valid ``step`` records of one job as columns (a ``step_columns`` chunk and
        the step of each row, e.g. ``bus_decode.StepBatch``), in arrival order: the same
        counters, clocks, marks and order as ``add_records``, with no per-record Python."""
        wall = self.cfg.clock == "wall"
        if self.cfg.clock != "record" and now is None:
            now = time.time()
        dropped = chunk.get("dropped")  # a metric column too (NaN: not reported)
        if dropped is not None and dropped.size and (d := int(np.nansum(dropped))):
            self._job(job).stats["dropped"] += d

        def put(p: Pending, a: int, b: int, idx: np.ndarray, whole: bool) -> None:
            p.seal()  # dict records that came before stay before
            sel = slice(a, b) if whole else idx
            p.chunks.append({k: v[sel] for k, v in chunk.items()})

        self._add_runs(self._job(job), chunk["t"], chunk["rank"], chunk["world"], step, now,
                       wall, put)  # fmt: skip

    def _add_runs(self, j: JobBuffer, t, rank, world, step, now, wall: bool, put) -> None:
        """Runs of one step in arrival order: refuse, count, mark, then ``put`` the rows."""
        n = rank.size
        t_ok = None
        far = t_far(j, t, self.cfg.max_t_ahead_s)
        if far is not None:
                j.stats["t_ahead"] += int(np.count_nonzero(far))
                t_ok = ~far
                t = np.where(far, np.nan, t)  # refused rows never move the clocks
        # the job clocks after each record (NaN never advances them)
        step_clock = np.fmax.accumulate(np.concatenate(([j.step_clock], t)))
        latest = float(step_clock[-1])
        if latest > j.clock:
            j.clock = latest
        j.step_clock = latest
        ok = (rank >= 0) & (rank < world) & (world <= self.cfg.max_world)
        refused = n - int(np.count_nonzero(ok))
        if t_ok is not None:
            ok &= t_ok
        voted = j.vote.add_rows(world[ok], rank[ok]) if ok.any() else None
        if voted is not None:
            j.stats["world_mismatch"] += int(np.count_nonzero(~voted))
            ok[np.flatnonzero(ok)[~voted]] = False
        j.world = j.vote.world
        acc = np.flatnonzero(ok)
        if refused:
            j.stats["refused"] += refused
        if acc.size == 0:
            return
        if self.cfg.clock == "event":
            j.mark.ranks(rank[acc], t[acc], now)
        s = step[acc]
        cuts = np.flatnonzero(s[1:] != s[:-1]) + 1
        bounds = [0, *cuts.tolist(), acc.size]
        whole = acc.size == n
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            first = int(acc[a])
            p = self._pending(j, int(s[a]), now if wall else float(step_clock[first + 1]), b - a)
            if p is None:
                continue
            idx = acc[a:b]
            top = int(world[idx].max())
            if len(p.flags) < top:
                p.grow(top)
            before = p.count  # == ranks flagged in ``seen``; a count beats a sort of ranks
            p.seen[rank[idx]] = True
            p.count = int(np.count_nonzero(p.seen))
            if b - a > p.count - before:
                j.stats["duplicates"] += b - a - (p.count - before)
            if not np.isnan(t[idx]).all():
                p.t_hi = max(p.t_hi, float(np.nanmax(t[idx])))
            put(p, a, b, idx, whole)
            j.stats["records"] += b - a

    def add_table(self, table, now: float | None = None) -> list[tuple[int, str]]:
        """Take an Arrow table of ``step`` records; returns ``(row, reason)`` of refused rows.

        Raises ``ValueError`` when the table cannot be used at all.
        """
        chunks, bad = split_step_table(table, self.cfg.max_world, self._decode_cache)
        wall = self.cfg.clock == "wall"
        if self.cfg.clock != "record" and now is None:
            now = time.time()
        for job, step, ch in chunks:
            j = self._job(job)
            dropped = ch.get("dropped")  # a metric column too (NaN: not reported)
            if dropped is not None and dropped.size and (d := int(np.nansum(dropped))):
                j.stats["dropped"] += d
            keep = None
            far = t_far(j, ch["t"], self.cfg.max_t_ahead_s)
            if far is not None:
                    j.stats["t_ahead"] += int(np.count_nonzero(far))
                    keep = ~far
            voted = j.vote.add_rows(ch["world"] if keep is None else ch["world"][keep],
                                    ch["rank"] if keep is None else ch["rank"][keep])  # fmt: skip
            if voted is not None:
                j.stats["world_mismatch"] += int(np.count_nonzero(~voted))
                if keep is None:
                    keep = voted
                else:
                    keep[np.flatnonzero(keep)[~voted]] = False
            if keep is not None:
                ch = {k: (v[keep] if v is not None else None) for k, v in ch.items()}
            j.world = j.vote.world
            if ch["rank"].size == 0:
                continue
            if self.cfg.clock == "event":
                j.mark.ranks(ch["rank"], ch["t"], now)
            with np.errstate(invalid="ignore"):
                t_max = float(np.nanmax(ch["t"])) if not np.isnan(ch["t"]).all() else -math.inf
            j.clock = max(j.clock, t_max)
            j.step_clock = max(j.step_clock, t_max)
            world = int(ch["world"].max())
            p = self._pending(j, step, now if wall else j.step_clock, ch["rank"].size)
            if p is None:
                continue
            before = p.count
            p.mark(ch["rank"], world)
            p.count = int(np.count_nonzero(p.seen))
            j.stats["duplicates"] += ch["rank"].size - (p.count - before)
            j.stats["records"] += ch["rank"].size
            p.t_hi = max(p.t_hi, t_max)
            p.seal()
            p.chunks.append(ch)
        return bad

    # -- output ------------------------------------------------------------
    def deadline_s(self, job: str) -> float:
        """How long a step of ``job`` may wait for its last rank."""
        j = self._jobs.get(job)
        if j is None or not j.durations:
            return self.cfg.initial_deadline_s
        med = statistics.median(j.durations)
        return max(self.cfg.deadline_factor * med, self.cfg.deadline_floor_s)

    def ready(self, now: float | None = None) -> list[StepFrame]:
        """Build every step that is complete or overdue, oldest first within each job.

        A complete step waits for an older step that is still open (detectors
        keep per-rank history, so steps must arrive in order); the older one
        is bounded by its deadline.
        """
        out: list[StepFrame] = []
        event = self.cfg.clock == "event"
        if self.cfg.clock != "record" and now is None:
            now = time.time()
        for j in self._jobs.values():
            at = now if self.cfg.clock == "wall" else j.step_clock
            if event and j.pending:  # the time every live rank's step records have reached
                at = j.mark.steps(j.world, now, self.cfg.stall_s, j.step_clock)
            while j.pending:
                step = min(j.pending)
                p = j.pending[step]
                overdue = at is not None and at - p.opened > self.deadline_s(j.name)
                crowded = len(j.pending) > self.cfg.max_pending_steps
                complete = p.count >= j.world and (  # a GPU job's samples up to it first
                    not (event and j.mark.gpu) or j.mark.gpu_done(p.t_hi, now, self.cfg.stall_s))
                if not (complete or overdue or crowded):
                    break
                if crowded and not overdue and p.count < j.world:
                    j.stats["forced"] += 1
                if far_ahead(j, p, self.cfg.max_step_ahead):  # one record must not move the step
                    j.stats["ahead"] += j.pending.pop(step).count
                    continue
                frame = self._emit_guarded(j, j.pending.pop(step))
                if frame is not None:
                    out.append(frame)
        return out

    def flush(self) -> list[StepFrame]:
        """Build every open step (end of a stream), in order."""
        out = []
        for j in self._jobs.values():
            for step in sorted(j.pending):
                if far_ahead(j, j.pending[step], self.cfg.max_step_ahead):
                    j.stats["ahead"] += j.pending.pop(step).count
                    continue
                frame = self._emit_guarded(j, j.pending.pop(step))
                if frame is not None:
                    out.append(frame)
        return out

    def _emit_guarded(self, j: JobBuffer, p: Pending) -> StepFrame | None:
        """``_emit``; a step that cannot be built is dropped and counted, never raised."""
        try:
            return self._emit(j, p)
        except Exception:
            j.stats["build_errors"] += 1
            if j.stats["build_errors"] <= 3:
                log.exception("job %s: step %s could not be built (dropped)", j.name, p.step)
            return None

    def _emit(self, j: JobBuffer, p: Pending) -> StepFrame | None:
        j.last_emitted = p.step
        p.seal()
        world = j.world
        chunks, seen, dropped = keep_world(p.chunks, p.seen, world)
        if dropped:  # accepted while the world was unsettled, then outvoted
            j.stats["world_mismatch"] += dropped
        if not chunks:
            j.stats["empty_steps"] += 1
            return None
        frame = build_frame(j.name, p.step, world, chunks, seen, j.groups)
        frame.checks = p.checks
        if j.gpu.samples:
            j.gpu.learn_hosts(frame.rank, frame.host)
            j.gpu.advance(frame.t if math.isfinite(frame.t) else math.inf)
            frame.gpu = j.gpu.columns(frame.rank)
        if j.hosts.size < world:
            j.hosts = np.concatenate([j.hosts, np.full(world - j.hosts.size, None, object)])
        j.hosts[frame.rank] = frame.host
        j.learn_duration(frame)
        j.stats["frames"] += 1
        if frame.missing.size:
            j.stats["partial_frames"] += 1
        return frame

    # -- queries -----------------------------------------------------------
    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def clock(self, job: str) -> float:
        """The job's record clock: the latest ``t`` seen in any of its records."""
        j = self._jobs.get(job)
        return j.clock if j is not None else -math.inf

    def watermark(self, job: str, now: float) -> float:
        """(``event``) Time up to which every live rank's records are in; else the latest t."""
        j = self._jobs.get(job)
        if j is None or self.cfg.clock != "event":
            return j.clock if j is not None else -math.inf
        return j.mark.records(j.world, now, self.cfg.stall_s, j.clock)

    def world(self, job: str) -> int:
        j = self._jobs.get(job)
        return j.world if j is not None else 0

    def hosts_of(self, job: str, ranks) -> list[str]:
        """Host names of ranks (as last seen in a step); ``?`` for a rank never seen."""
        j = self._jobs.get(job)
        out = []
        for r in ranks:
            h = j.hosts[r] if j is not None and 0 <= r < j.hosts.size else None
            out.append(h if h is not None else "?")
        return out

    def stats(self, job: str) -> dict[str, int]:
        """Counters: records, duplicates, late, refused, frames, partial_frames, forced, ..."""
        j = self._jobs.get(job)
        return dict(j.stats) if j is not None else {}

    def pending_steps(self, job: str) -> list[int]:
        j = self._jobs.get(job)
        return sorted(j.pending) if j is not None else []

    # -- persistence -------------------------------------------------------
    def state_dict(self) -> dict:
        """What outlives a restart: per job world, last step built, step times, host map.

        Open steps are not saved: after a restart the bus re-delivers their
        records (offsets are committed only after a step's findings are stored).
        """
        return {name: j.state_dict() for name, j in self._jobs.items()}

    def load_state_dict(self, d: dict) -> None:
        for name, s in d.items():
            self._job(name).load_state_dict(s)

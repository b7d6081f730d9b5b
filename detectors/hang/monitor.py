"""Hangs and crashed ranks, from progress beats.

Design notes: docs/hangs.md, "detectors/hang/monitor.py".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from rankscope.detectors.hang.clock import clock_offsets, now_corrected, silent_s, since
from rankscope.detectors.hang.early import crash_limit, crashed_early, job_quiet, silent_job
from rankscope.detectors.hang.evidence import build_signals
from rankscope.detectors.hang.groups import axis_groups, instance_namer
from rankscope.detectors.hang.state import Job as _Job
from rankscope.detectors.hang.state import Rank as _Rank
from rankscope.detectors.hang.state import is_closed, job_from_dict, job_to_dict
from rankscope.detectors.hang.wait_graph import Localization, RankView, localize
from rankscope.detectors.signal import Signal

__all__ = ["Config", "HangMonitor"]

OFFSET_REFRESH_STEPS = 4


@dataclass(kw_only=True, slots=True)
class Config:
    """When a job counts as stalled and a rank as silent."""

    stall_min_s: float = 10.0
    """Shortest live stall (seconds without any rank finishing a step) ever declared: a
    hang is named within max(this, ``stall_step_factor`` x the p99 step time)."""
    stall_step_factor: float = 10.0
    """A stall also needs this many p99 recent step times without progress."""
    end_stall_min_s: float = 5.0
    """At the end of a trace (``check_end``: the end of the trace is the end of the job,
    no more beats can come) a stall of max(this, ``stall_step_factor`` x the p99 step
    time) is enough: the job was killed stuck (e.g. by a watchdog)."""
    crash_s: float = 5.0
    """A rank whose beats stop while its peers beat on, waiting in collectives, is named
    crashed within this many seconds of its last beat, before any stall deadline."""
    crash_margin_s: float = 2.0
    """What of ``crash_s`` the beats' travel and the next check take (``serve``'s clock
    trails the wall by up to ``watermark.DELIVERY_S``): a crash is named after
    ``crash_s - crash_margin_s`` of silence."""
    crash_beat_factor: float = 3.0
    """...and after at least this many of the rank's own median beat gaps."""
    step_window: int = 32
    """How many recent step durations the median uses."""
    silence_min_s: float = 10.0
    """Shortest beat silence (seconds) after which a rank counts as stopped."""
    silence_beat_factor: float = 5.0
    """A rank is silent after this many of its own median beat gaps without a beat."""
    beat_window: int = 16
    """How many recent beat gaps per rank the median uses."""
    offset_steps: int = 8
    """How many recent step boundaries the per-rank clock offset uses."""
    evidence_ranks: int = 32
    """At most this many ranks are described one by one in a signal's evidence."""
    stamp_at_check: bool = False
    """Live service: beats given without ``now`` arrive at the ``now`` of the next
    ``check`` (the service's clock) rather than at their own ``t`` (replay)."""

    def __post_init__(self) -> None:
        if not self.stall_min_s > 0:
            raise ValueError("hang Config: stall_min_s should be > 0")
        if not self.stall_step_factor >= 1:
            raise ValueError("hang Config: stall_step_factor should be >= 1")
        if not 0 <= self.crash_margin_s < self.crash_s:
            raise ValueError("hang Config: crash_margin_s should be >= 0 and < crash_s")
        if not self.crash_beat_factor >= 1:
            raise ValueError("hang Config: crash_beat_factor should be >= 1")
        if not self.end_stall_min_s > 0:
            raise ValueError("hang Config: end_stall_min_s should be > 0")
        if self.step_window < 1 or self.beat_window < 1 or self.offset_steps < 1:
            raise ValueError("hang Config: step_window, beat_window, offset_steps should be >= 1")
        if not self.silence_min_s > 0:
            raise ValueError("hang Config: silence_min_s should be > 0")
        if not self.silence_beat_factor >= 1:
            raise ValueError("hang Config: silence_beat_factor should be >= 1")
        if self.evidence_ranks < 1:
            raise ValueError("hang Config: evidence_ranks should be >= 1")


def _rows(records) -> Iterable[dict]:
    """Accept dict records, a pyarrow Table/RecordBatch, or a dict of columns."""
    if hasattr(records, "to_pylist"):
        return records.to_pylist()
    if isinstance(records, dict):
        cols = {k: v.tolist() if hasattr(v, "tolist") else list(v) for k, v in records.items()}
        n = max((len(v) for v in cols.values()), default=0)
        return ({k: v[i] for k, v in cols.items()} for i in range(n))
    return records


_closed = is_closed


def _blocked(rs: _Rank) -> bool:
    """Inside an unfinished collective: beating from it, or stopped (``idle``) while in it."""
    if rs.group is None or rs.done:
        return False
    return rs.phase == "collective" or (rs.phase == "idle" and rs.done is False)


class HangMonitor:
    """Watches beats of many jobs; ``check(now)`` says who hangs and who crashed."""

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or Config()
        self._jobs: dict[str, _Job] = {}
        self._unstamped: list[dict] = []  # beats waiting for the next check's clock
        self._unstamped_steps: list[tuple[str, int, float]] = []

    # ---- input -------------------------------------------------------------
    def _job(self, job: str) -> _Job:
        j = self._jobs.get(job)
        if j is None:
            j = self._jobs[job] = _Job(
                durations=deque(maxlen=self.cfg.step_window),
            )
        return j

    def set_job_info(self, job: str, *, world: int | None = None, groups=None) -> None:
        """Declare the world size and group memberships (name -> ranks) when known."""
        j = self._job(job)
        if world is not None:
            j.world = max(j.world or 0, int(world))
        for name, ranks in (groups or {}).items():
            j.groups.setdefault(str(name), set()).update(int(r) for r in ranks)

    def observe_beats(self, records, now: float | None = None) -> int:
        """Take ``beat`` records (other types are ignored); returns how many were used.

        ``now`` is the arrival time of the batch on the caller's clock; when
        None each beat's own ``t`` stands in for it (replay), or with
        ``stamp_at_check`` the ``now`` of the next ``check`` does (live).
        """
        used = 0
        for rec in _rows(records):
            if rec.get("type", "beat") != "beat":
                continue
            if now is None and self.cfg.stamp_at_check:
                self._unstamped.append(rec)
                used += 1
                continue
            used += self._observe_safe(rec, now)
        return used

    def _observe_safe(self, rec: dict, now: float | None) -> int:
        try:
            self._observe_one(rec, now)
        except (KeyError, TypeError, ValueError):
            return 0  # malformed beat: the reader reports those; never raise here
        return 1

    def _observe_one(self, rec: dict, now: float | None) -> None:
        cfg = self.cfg
        j = self._job(str(rec["job"]))
        r = int(rec["rank"])
        t = float(rec["t"])
        arrival = t if now is None else float(now)
        rs = j.ranks.get(r)
        if rs is None:
            rs = j.ranks[r] = _Rank(rank=r, gaps=deque(maxlen=cfg.beat_window))
        was_closed = _closed(rs)
        if j.first_arrival is None or arrival < j.first_arrival:
            j.first_arrival = arrival
        if arrival > rs.last_arrival:
            if rs.last_arrival > float("-inf"):
                rs.gaps.append(arrival - rs.last_arrival)
            rs.last_arrival = arrival
        if rec.get("world") is not None:
            j.world = max(j.world or 0, int(rec["world"]))
        step = int(rec["step"])
        if rs.step is None or step > rs.step:
            if rs.step is not None:
                if rs.step_t is not None and t > rs.step_t:
                    j.durations.append((t - rs.step_t) / (step - rs.step))
                if j.last_progress is None or arrival >= j.last_progress[0]:
                    j.last_progress = (arrival, r)
                self._boundary(j, r, step, arrival)
            rs.step, rs.step_t = step, t
        group = rec.get("coll_group")
        seq = rec.get("coll_seq")
        if group is not None:
            group = str(group)
            if rec.get("coll_ranks"):  # declared membership; otherwise it is inferred
                j.groups.setdefault(group, set()).update(int(x) for x in rec["coll_ranks"])
            if seq is not None:
                seq = int(seq)
                rs.entered[group] = max(rs.entered.get(group, -1), seq)
                if rec.get("coll_done"):
                    rs.finished[group] = max(rs.finished.get(group, -1), seq)
        if t >= rs.last_t:  # the newest beat of this rank says what it does now
            rs.last_t = t
            rs.host = rec.get("host", rs.host)
            rs.phase = rec.get("phase")
            if rs.phase != "idle":
                rs.busy_phase = rs.phase
            rs.group, rs.seq, rs.op = group, seq, rec.get("coll_op")
            rs.done = rec.get("coll_done")
            peer = rec.get("coll_peer")
            rs.peer = int(peer) if peer is not None else None
        j.n_closed += int(_closed(rs)) - int(was_closed)

    def observe_step_end(self, job: str, step: int, t: float, now: float | None = None) -> None:
        """An assembled step finished (from step records): progress, and a step duration."""
        j = self._job(job)
        arrival = t if now is None else float(now)
        if j.first_arrival is None or arrival < j.first_arrival:
            j.first_arrival = arrival
        if j.step_end is None or step > j.step_end[0]:
            if j.step_end is not None and t > j.step_end[1]:
                j.durations.append((t - j.step_end[1]) / (step - j.step_end[0]))
            j.step_end = (int(step), float(t))
            if j.last_step_end is None or arrival >= j.last_step_end[0]:
                j.last_step_end = (arrival, now is not None)

    def _boundary(self, j: _Job, r: int, step: int, arrival: float) -> None:
        if step not in j.boundaries:
            j.offsets_age += 1
        j.boundaries.setdefault(step, {})[r] = arrival
        while len(j.boundaries) > self.cfg.offset_steps:
            del j.boundaries[min(j.boundaries)]

    def offsets(self, job: str) -> dict[int, float]:
        """Per-rank clock offset (seconds ahead of the median rank) from step boundaries."""
        j = self._jobs.get(job)
        if j is None:
            return {}
        # Offsets drift slowly: recompute every few new steps, not on every check.
        if j.offsets is None or j.offsets_age >= OFFSET_REFRESH_STEPS:
            j.offsets, j.offsets_age = clock_offsets(j.boundaries), 0
        return j.offsets

    def observe_frame(self, frame) -> None:
        """An assembled ``StepFrame`` (the engine's hook): a step end, and the world size."""
        self.set_job_info(frame.job, world=frame.world or None)
        j = self._job(frame.job)
        if frame.coords and len(j.coords) < max(j.world or 0, frame.n):
            axes = sorted(frame.coords)
            cols = [frame.coords[a].tolist() for a in axes]
            for i, r in enumerate(frame.rank.tolist()):
                j.coords[int(r)] = tuple((a, int(c[i])) for a, c in zip(axes, cols, strict=True))
        if not math.isfinite(frame.t):
            return
        if self.cfg.stamp_at_check:
            self._unstamped_steps.append((frame.job, frame.step, frame.t))
        else:
            self.observe_step_end(frame.job, frame.step, frame.t)

    # ---- verdict -----------------------------------------------------------
    def deadline_s(self, job: str) -> float:
        """Seconds without progress after which ``job`` counts as stalled (live)."""
        return self._deadline(job, self.cfg.stall_min_s)

    def end_deadline_s(self, job: str) -> float:
        """The stall that counts at the end of a trace: max(end_stall_min_s, factor x p99)."""
        return self._deadline(job, self.cfg.end_stall_min_s)

    def _deadline(self, job: str, floor: float) -> float:
        j = self._jobs.get(job)
        if j is None or not j.durations:
            return floor
        d = sorted(j.durations)
        p99 = d[min(len(d) - 1, math.ceil(0.99 * len(d)) - 1)]
        return max(floor, self.cfg.stall_step_factor * p99)

    def _silence_limit(self, rs: _Rank) -> float:
        gap = statistics.median(rs.gaps) if rs.gaps else 0.0
        return max(self.cfg.silence_min_s, self.cfg.silence_beat_factor * gap)

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def check_end(self, now: float, job: str | None = None) -> list[Signal]:
        """``check`` at the end of a trace: the stall deadline is ``end_deadline_s``, and
        no beat is on its way (a rank not closed when the others did has vanished)."""
        return self.check(now, job, deadline=self.end_deadline_s, end=True)

    def check(self, now: float, job: str | None = None, *, deadline=None, end: bool = False
              ) -> list[Signal]:  # fmt: skip
        """Signals for stalled jobs whose verdict is new or changed since the last check.

        ``deadline``: job -> seconds (default ``deadline_s``, the live stall deadline);
        ``end``: the end of the trace (``check_end``).
        """
        deadline_of = deadline or self.deadline_s
        pending, self._unstamped = self._unstamped, []
        for rec in pending:
            self._observe_safe(rec, now)
        steps, self._unstamped_steps = self._unstamped_steps, []
        for job_name, step, t in steps:
            self.observe_step_end(job_name, step, t, now=now)
        out: list[Signal] = []
        for name in [job] if job is not None else sorted(self._jobs):
            j = self._jobs.get(name)
            if j is None or j.first_arrival is None:
                continue
            loc = self._verdict(name, j, now, deadline_of(name), end)
            if loc is None:
                continue
            key = (tuple(loc.hang), tuple(loc.crash), tuple(loc.unattributed))
            if key == j.reported or not any(key):
                continue
            j.reported = key
            offsets = self.offsets(name)
            now_c = now_corrected(j, now, offsets)
            stalled = now_c - since(j, offsets)
            out.extend(
                build_signals(name, j, loc, now_c, offsets, stalled, deadline_of(name),
                              self.cfg.evidence_ranks)  # fmt: skip
            )
        return out

    def _verdict(self, name: str, j: _Job, now: float, deadline: float, end: bool
                 ) -> Localization | None:  # fmt: skip
        """What to say about one job now: None while it is not stalled; else who hangs,
        who crashed (early: before the deadline), or, for a job fallen wholly silent,
        nobody (``early.py``)."""
        offsets = self.offsets(name)
        now_c = now_corrected(j, now, offsets)
        stalled = now_c - since(j, offsets)
        ended = self.ended_abnormally(name, now, end)
        if stalled < deadline and not ended:
            crashed = crashed_early(self.cfg, j, now_c, offsets, stalled)
            if not crashed:
                if stalled < self.cfg.crash_s - self.cfg.crash_margin_s:
                    j.reported = None  # progress since: a later stall is a new one
                return None
            loc, _ = self.localize(name, now, silence=lambda rs: crash_limit(self.cfg, rs))
            return Localization(crash=[r for r in loc.crash if r in crashed], waiting=loc.waiting,
                                reasons=loc.reasons)  # fmt: skip
        loc, _ = self.localize(name, now, end=end)
        if not ended and job_quiet(self.cfg, j, now_c, offsets):
            if j.reported and (j.reported[0] or j.reported[1]):
                return None  # its culprits were named before it fell silent
            return silent_job(j, loc, now_c, offsets)
        return loc

    @staticmethod
    def _views(j: _Job, universe, alive: dict[int, bool], split: bool) -> dict[int, RankView]:
        views: dict[int, RankView] = {}
        for r in sorted(universe):
            rs = j.ranks.get(r)
            if rs is None:
                views[r] = RankView(rank=r, seen=False, alive=False)
                continue
            name = instance_namer(j, r) if split else (lambda g: g)
            views[r] = RankView(
                rank=r,
                alive=alive[r],
                blocked=_blocked(rs),
                head_group=name(rs.group),
                head_seq=rs.seq,
                head_peer=rs.peer,
                head_op=rs.op,
                entered={name(g): n for g, n in rs.entered.items()},
                done={name(g): n for g, n in rs.finished.items()},
            )
        return views

    def ended_abnormally(self, job: str, now: float, end: bool = False) -> bool:
        """Some rank closed (final ``idle`` beat) while inside an unfinished collective,
        and every other rank closed too or went quiet (no beat since the first close,
        and silent for its crash limit, a close beat may still be on its way; at the
        ``end`` of a trace none is): the job died hung, no progress can come, no
        deadline to wait."""
        j = self._jobs[job]
        if j.n_closed == 0:
            return False
        offsets = self.offsets(job)
        now_c = now_corrected(j, now, offsets)
        closed = [rs for rs in j.ranks.values() if _closed(rs)]
        if not any(_blocked(rs) for rs in closed):
            return False
        first_close = min(rs.last_arrival - offsets.get(rs.rank, 0.0) for rs in closed)
        for rs in j.ranks.values():
            if _closed(rs):
                continue
            # still running unless it went quiet before the others began to close
            quiet_before = rs.last_arrival - offsets.get(rs.rank, 0.0) < first_close
            silence = silent_s(rs, now_c, offsets)
            gone = quiet_before and (end or silence >= crash_limit(self.cfg, rs))
            if not gone and silence <= self._silence_limit(rs):
                return False
        return True

    def localize(self, job: str, now: float, silence=None, end: bool = False
                 ) -> tuple[Localization, dict[int, RankView]]:  # fmt: skip
        """The wait-for verdict for ``job`` as of ``now`` (no stall test, no state change);
        ``silence``: rank -> seconds after which it counts as stopped (default: silent);
        ``end``: the end of the trace."""
        j = self._jobs[job]
        offsets = self.offsets(job)
        now_c = now_corrected(j, now, offsets)
        ended = self.ended_abnormally(job, now, end)
        universe = set(j.ranks)
        for members in j.groups.values():
            universe |= members
        if j.world:
            universe |= set(range(j.world))
        alive: dict[int, bool] = {}
        for r, rs in j.ranks.items():
            if ended:  # who closed properly vs who vanished without a final beat
                alive[r] = _closed(rs)
            else:
                alive[r] = silent_s(rs, now_c, offsets) <= (silence or self._silence_limit)(rs)
        views = self._views(j, universe, alive, split=True)
        loc = localize(views, {**axis_groups(j, views), **j.groups})
        if loc.unattributed and j.coords:
            # Coordinates may not match the real groups (a plain data-parallel job
            # given emulated coordinates): keep whichever grouping leaves fewer
            # waits unexplained.
            merged = self._views(j, universe, alive, split=False)
            other = localize(merged, j.groups)
            if len(other.unattributed) < len(loc.unattributed):
                loc, views = other, merged
        # Fail-stop: a rank that stopped beating while others still beat has
        # crashed even when nobody is (yet) seen waiting for it.
        if any(v.alive for v in views.values()):
            silent = {r for r, v in views.items() if v.seen and not v.alive}
            for r in sorted(silent - set(loc.crash)):
                loc.crash.append(r)
                loc.reasons[r] = (
                    "vanished without a final beat while the others closed"
                    if ended
                    else "stopped beating while other ranks still beat"
                )
            loc.crash.sort()
            loc.hang = [r for r in loc.hang if r not in silent]
            loc.unattributed = [r for r in loc.unattributed if r not in silent]
        return loc, views

    # ---- persistence -------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON-able state, so a restarted service keeps its step history."""
        return {"version": 1, "jobs": {name: job_to_dict(j) for name, j in self._jobs.items()}}

    def load_state_dict(self, d: dict) -> None:
        if d.get("version") != 1:
            raise ValueError(f"hang monitor state version {d.get('version')!r} is not 1")
        self._jobs = {
            name: job_from_dict(jd, self.cfg.step_window, self.cfg.beat_window)
            for name, jd in d.get("jobs", {}).items()
        }


NAME = "hang"
CONFIG = Config


def make_monitor(cfg: Config, live: bool) -> HangMonitor:
    """One job's monitor; ``live`` stamps beats with the service's clock at check time."""
    return HangMonitor(dataclasses.replace(cfg, stamp_at_check=live))

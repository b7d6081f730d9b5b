"""Network: the rank (or link) everybody's communication waits for.

Design notes: docs/detectors.md, "detectors/network/detector.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame, diverged, work_group
from rankscope.detectors.network.late_arrival import LastArrivalScan, min_count
from rankscope.detectors.network.late_window import late_residual_hits
from rankscope.detectors.network.waits import Waits, collective_waits
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.stats.consensus import (
    excess_floor_s,
    frame_consensus,
    group_min,
    peer_consensus,
    readings,
    step_reference_s,
    strict_majority,
)
from rankscope.detectors.stats.consensus_config import ConsensusConfig
from rankscope.detectors.stats.history import RankHistory
from rankscope.detectors.stats.history_state import PartsState, make_window
from rankscope.detectors.stats.peers import PeerCache
from rankscope.detectors.stats.persistence import FlagRate, StreakCounter, required_streak

__all__ = ["NetworkConfig", "NetworkState", "detect"]

NAME = "network"
_COLS = ("comm_s", "compute_s", "data_s")
CLOCK_EVERY = 16  # once a rank's clock offset baseline is full, one clean step in this many


@dataclass(kw_only=True, slots=True)
class NetworkConfig(ConsensusConfig):
    """Settings of the communication localization detector (times in seconds); the shared
    peer-consensus settings (z_min on comm_s skew, wait floors, streaks, history of the
    job's comm_s, windows of unexplained lateness) come from ``ConsensusConfig``."""

    victim_frac: float = 0.5  # a root waited itself less than this share of what it was waited for
    compute_explains_frac: float = 0.5  # own compute/data excess this large explains lateness
    slow_ratio: float = 1.5  # a collective without a late arriver is slow above this x typical
    # a root's wait must exceed this x the job's usual arrival gap, and the largest
    # usual gap of the recent clean steps
    noise_ratio: float = 3.0
    always_below_rows: int = 64  # jobs this small analyse collectives every step
    late_window: int = 20  # steps over which arrival order is counted
    late_work_ratio: float = 1.1  # own compute + input this x peers' (window median): a straggler
    late_chance_per_step: float = 1e-3  # tolerated chance "always last" counts per step, job
    last_margin: float = 1.0  # last only by this x the excess floor (max 2 ms, 3 % step)
    # a late return's window mean over its usual must exceed this and the excess floor
    # (3 % of the step): a crowded host's comm thread is late by 2-5 ms for a few steps
    # in a row (clean p99 of one step 5-8 ms), a slow link's by 14-22 ms; the noise is
    # the host's, in milliseconds, not a share of the step
    late_return_floor_s: float = 0.010

    def __post_init__(self) -> None:
        ConsensusConfig.__post_init__(self)  # zero-argument super() fails on slotted dataclasses
        if not 0 < self.victim_frac <= 1 or not 0 < self.compute_explains_frac <= 1:
            raise ValueError("victim_frac and compute_explains_frac must be in (0, 1]")
        if self.slow_ratio <= 1 or self.history_ratio < 1 or self.noise_ratio < 1:
            raise ValueError("need slow_ratio > 1, history_ratio >= 1, noise_ratio >= 1")
        if self.always_below_rows < 0:
            raise ValueError("always_below_rows must be >= 0")
        if self.late_window < 4 or self.late_work_ratio < 1:
            raise ValueError("need late_window >= 4 and late_work_ratio >= 1")
        if not 0 < self.late_chance_per_step < 1:
            raise ValueError("late_chance_per_step must be in (0, 1)")
        if self.last_margin < 0 or self.late_return_floor_s < 0:
            raise ValueError("last_margin and late_return_floor_s must be >= 0")


class NetworkState(PartsState):
    """Peer cache, per-rank comm history (evidence), job comm baseline, typical collectives."""

    __slots__ = (
        "peers",
        "history",
        "job",
        "typical",
        "pending",
        "gaps",
        "pending_gap",
        "pending_job",
        "lateness",
        "pending_lateness",
        "resid",
        "pending_resid",
        "held",
        "pending_held",
        "held_quiet",
        "held_window",
        "job_peers",
        "work_peers",
        "scan",
        "streak",
        "pair_streak",
        "rate",
        "pair_rate",
        "window",
        "cfg",
    )
    PARTS = (
        "history", "job", "lateness", "resid", "scan",
        "streak", "pair_streak", "rate", "pair_rate", "window", "held", "held_window",
    )  # fmt: skip
    REQUIRED = ("history", "job")

    def __init__(self, cfg: NetworkConfig) -> None:
        self.cfg = cfg
        self.peers = PeerCache()
        self.history = RankHistory(("comm_s",), cfg.history_steps)
        self.job = RankHistory(("comm_s",), cfg.history_steps)  # one "rank": the job median
        self.typical: dict[str, list[float]] = {}  # group name -> recent typical s
        self.pending: dict[str, float] = {}  # this step's typical s, learnt if the step is clean
        self.gaps: list[float] = []  # recent clean steps' median wait for a last arriver
        self.pending_gap: float | None = None
        self.pending_job: float | None = None  # this step's median of peer-group comm medians
        self.lateness = RankHistory(("lateness",), cfg.history_steps)  # clock offsets
        self.pending_lateness: np.ndarray | None = None
        # lateness less own work excess: its per-rank usual value (clock offset, habit)
        self.resid = RankHistory(("resid",), cfg.history_steps)
        self.pending_resid: np.ndarray | None = None
        # time still inside a collective its peers had left, and its per-rank usual value
        self.held = RankHistory(("held",), cfg.history_steps)
        self.pending_held: np.ndarray | None = None
        self.held_quiet: np.ndarray | None = None  # rows whose late return may teach it
        self.held_window = make_window(cfg)
        self.job_peers = PeerCache()  # the whole job as one group (late returns)
        self.work_peers = PeerCache()  # ranks doing the same work (frame.work_group)
        self.scan = LastArrivalScan(cfg.late_window)
        self.streak = StreakCounter()
        self.pair_streak = StreakCounter()
        self.rate = FlagRate(cfg.history_steps)
        self.pair_rate = FlagRate(cfg.history_steps)
        self.window = make_window(cfg)

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        if diverged(frame):  # not the model's work: nothing to learn (``detect``)
            return
        self.history.learn(frame.rank, frame.m, clean_mask)
        clean_frac = float(np.mean(clean_mask)) if clean_mask.size else 0.0
        self.window.learn(clean_frac, frame.step)
        self.held_window.learn(clean_frac, frame.step)
        # a clock offset is near constant: fill the baseline, then follow it only slowly
        # (one step in CLOCK_EVERY), so a fault that makes a rank late is not learnt as
        # its clock within a few steps; its usual residual and late return the same way
        for hist, name, pend in ((self.lateness, "lateness", "pending_lateness"),
                                 (self.resid, "resid", "pending_resid"),
                                 (self.held, "held", "pending_held")):
            values = getattr(self, pend)
            setattr(self, pend, None)
            if values is not None and values.shape[0] == frame.n:
                have, _ = hist.median(frame.rank, name)
                slow = (have < self.cfg.history_steps) | (frame.step % CLOCK_EVERY == 0)
                if name == "held" and self.held_quiet is not None:
                    slow = slow & self.held_quiet
                hist.learn(frame.rank, {name: values}, clean_mask & slow)
        self.held_quiet = None
        if clean_mask.size == 0 or clean_mask.mean() < 0.9:  # a troubled step teaches nothing
            self.pending, self.pending_gap, self.pending_job = {}, None, None
            return
        if self.pending_job is not None and np.isfinite(self.pending_job):
            med = np.array([self.pending_job])
            self.job.learn(np.zeros(1, dtype=np.int64), {"comm_s": med}, np.ones(1, dtype=bool))
        for name, s in self.pending.items():
            ring = self.typical.setdefault(name, [])
            ring.append(s)
            del ring[: -self.cfg.history_steps]
        if self.pending_gap is not None:
            self.gaps.append(self.pending_gap)
            del self.gaps[: -self.cfg.history_steps]
        self.pending, self.pending_gap, self.pending_job = {}, None, None

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["typical"] = {k: list(v) for k, v in self.typical.items()}
        out["gaps"] = list(self.gaps)
        return out

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        self.typical = {str(k): [float(x) for x in v] for k, v in d.get("typical", {}).items()}
        self.gaps = [float(x) for x in d.get("gaps", [])]


def detect(frame: StepFrame, state: NetworkState, cfg: NetworkConfig) -> DetectorOutput:
    """The rank or link its peers' collectives wait for, persistently."""
    out = DetectorOutput()
    n = frame.n
    if n == 0 or diverged(frame):  # NaN weights everywhere: timing blames no one
        return out
    idx = state.peers.get(frame.group)
    nan = np.full(n, np.nan)
    c = frame_consensus(frame, idx, ("comm_s",))
    out.scores = {"comm_s": c.scores(("comm_s",))["comm_s"]}
    comm, med = c.x[0], c.median[0]
    floor = cfg.min_excess_s
    with np.errstate(invalid="ignore"):
        skew = np.abs(c.z[0]) > cfg.z_min
        if skew.any():
            skew &= np.abs(comm - med) > floor
        if skew.any() or n <= cfg.always_below_rows:  # the step floor costs a median
            floor = excess_floor_s(frame, cfg)
            skew &= np.abs(comm - med) > floor
    has_colls = bool(frame.collectives) and any(frame.collectives)
    gmed = c.group_median[0]
    state.pending_job = float(np.nanmedian(gmed)) if np.isfinite(gmed).any() else None
    if not (n <= cfg.always_below_rows or skew.any() or _job_comm_high(state, cfg)):
        for streaks, rate in ((state.streak, state.rate), (state.pair_streak, state.pair_rate)):
            if streaks.count.any():  # nothing deviates this step: streaks end
                prev = streaks.peek(frame.rank)
                streaks.update(frame.rank, np.zeros(n, dtype=bool))
                required_streak(rate, prev, np.zeros(n, dtype=bool), n, cfg, leaky=False)
            else:
                rate.observe(0, n)
        return out
    floor = excess_floor_s(frame, cfg)
    # from here on the step is being analysed: own compute / input / unaccounted times join in
    x = readings(frame, _COLS)
    x = np.vstack([x, _unaccounted(frame, x, nan)[None, :]])
    c = peer_consensus(idx, x)
    if has_colls:
        w = collective_waits(frame, floor_s=floor)
        state.pending = dict(w.typical_s)
        state.pending_gap = float(np.median(w.gaps)) if w.gaps else None
        if len(state.gaps) >= cfg.history_min_steps:  # arrival noise of this job
            ring = np.asarray(state.gaps)
            floor = max(floor, cfg.noise_ratio * float(np.median(ring)), float(ring.max()))
        elif n <= cfg.always_below_rows:  # a small job learns its noise before it judges
            floor = np.inf
        rule = np.full(n, "", dtype=object)
        rule[w.awaited_s > 0] = "last_arrival_or_shortest_wait"
        _intersection(w, state, cfg, floor, rule)
        late, late_win = _persistent_late(frame, idx, w, c, state, cfg)
        held = _late_return(frame, w, state, cfg)
        late |= held
        rule[held] = "late_return_window"
    else:
        w, rule = _from_comm_s(idx, c, cfg, floor, n)
        late = late_win = held = np.zeros(n, dtype=bool)
    # own work against its dp peers and against every rank doing the same work (tp
    # partners too: in a dp group of two the median is half the rank itself, and
    # explains half its lateness); the larger excess is what its own work explains.
    # A group of two is judged against the other member: a pp stage's straggler
    # computing 26 ms over its replica was 13 ms over their median, under half the
    # 37 ms it was awaited, and came out a link (network observes on 1.25x runs)
    widx = state.work_peers.get(work_group(frame))
    work = peer_consensus(widx, x[1:])
    with np.errstate(invalid="ignore"):
        ref = np.where(c.count[1:] == 2, group_min(idx, x[1:]), c.median[1:])
        wref = np.where(work.count == 2, group_min(widx, x[1:]), work.median)
        excess = np.fmax(x[1:] - ref, x[1:] - wref)
        own_excess = np.nan_to_num(excess[0:2], nan=0.0).max(axis=0)
        gap_excess = np.nan_to_num(excess[2], nan=0.0)
    # without arrival times the only evidence is a shorter wait: time the record does
    # not account for explains that as well as a late arrival does
    no_t0 = ~np.isfinite(w.lateness) if w.lateness.shape[0] == n else np.ones(n, dtype=bool)
    own_excess = np.where(no_t0, np.maximum(own_excess, gap_excess), own_excess)
    explained = own_excess >= cfg.compute_explains_frac * w.awaited_s
    root = (w.awaited_s > floor) & (w.waited_s < cfg.victim_frac * w.awaited_s) & ~explained
    if late.any():
        # a late arrival its own work explains is a straggler's, counted last or windowed
        # (a long straggler's small unexplained remainder adds up in the window)
        late &= held | ~explained
        root |= late
        rule[late_win & (rule == "")] = "late_arrival_window"
        rule[late & (rule == "")] = "persistent_last_arrival"
    if root.sum() * 2 >= n:  # no healthy majority: the whole job is slow, not one rank
        root &= held  # a late return had its own majority, over its window: not one step's
    solid = root & ((w.awaited_k >= 3) | np.array([len(p) >= 2 for p in w.partners]))
    pair = root & ~solid
    prev, pprev = state.streak.peek(frame.rank), state.pair_streak.peek(frame.rank)
    streak = state.streak.update(frame.rank, solid)
    pstreak = state.pair_streak.update(frame.rank, pair)
    need = required_streak(state.rate, prev, solid, n, cfg, leaky=False)
    pneed = required_streak(state.pair_rate, pprev, pair, n, cfg, leaky=False)
    for row in np.flatnonzero(solid & (streak >= need)):
        out.signals.append(_signal(frame, idx, c, w, state, int(row), str(rule[row]), False))
    for row in np.flatnonzero(pair & (pstreak >= pneed)):
        out.signals.append(_signal(frame, idx, c, w, state, int(row), str(rule[row]), True))
    return out


def _unaccounted(frame: StepFrame, x: np.ndarray, nan: np.ndarray) -> np.ndarray:
    """Step time the record does not account for: ``step_s`` less compute, comm and data.

    Zero in rankscope's own records (compute is what is left); another tool's
    trace can leave a gap (e.g. pipeline bubbles). A rank that waited less
    because it spent that time elsewhere, with no more compute and no longer
    step, is explained by it: less waiting is not a network fault.
    """
    with np.errstate(invalid="ignore"):
        return frame.m.get("step_s", nan) - np.nan_to_num(x).sum(axis=0)


def _persistent_late(frame, idx, w: Waits, c, state: NetworkState, cfg: NetworkConfig):
    """Rows that arrive last far more often than fair turns allow, their own work normal."""
    n = frame.n
    lat = w.lateness
    state.pending_lateness = lat
    late = np.zeros(n, dtype=bool)
    if lat.shape[0] != n or not np.isfinite(lat).any():
        return late, late.copy()
    _, offset = state.lateness.median(frame.rank, "lateness")  # the rank's clock offset
    corr = lat - np.where(np.isfinite(offset), offset, 0.0)
    rows, k = idx.argmax_rows(corr)
    top2 = np.sort(np.nan_to_num(idx.matrix(corr), nan=-np.inf), axis=1)[:, -2:]
    base_floor = excess_floor_s(frame, cfg)
    # last by a margin that costs its peers something: by a hair it is a coin flip, and a
    # crowded host's coin flips come in runs
    clear = top2[:, 1] - top2[:, 0] > cfg.last_margin * base_floor
    members = idx.rows(k)
    last_now = np.zeros(n, dtype=bool)
    last_now[rows[(rows >= 0) & (k >= 3) & clear]] = True
    seen = np.isfinite(corr) & (members >= 3)
    with np.errstate(invalid="ignore", divide="ignore"):
        # what kept it from arriving: compute, input, and waits in point-to-point
        # transfers (a stage blocked on its slow upstream neighbour is its victim)
        own = np.nan_to_num(c.x[1], nan=0.0) + np.nan_to_num(c.x[2], nan=0.0)
        p2p = w.p2p_waited_s if w.p2p_waited_s.shape[0] == n else np.zeros(n)
        if p2p.any():
            own = own + p2p
            work = own / peer_consensus(idx, own[None, :]).median[0]
        else:
            work = own / (np.nan_to_num(c.median[1], nan=0.0) + np.nan_to_num(c.median[2], nan=0.0))
    times_last, steps, work_ratio = state.scan.update(frame.rank, last_now, work, seen)
    count, usual = state.resid.median(frame.rank, "resid")
    usual = np.where(count >= cfg.history_min_steps, usual, np.nan)
    hit, mean, state.pending_resid = late_residual_hits(
        idx, frame.rank, lat, own, usual, state.window,
        floor_s=base_floor, chance=cfg.chance_findings_per_step, reach=w.reach,
    )
    if hit.any():  # a rank that waited for others this step longer than its group
        # typically did and than its lateness is a victim: what its shorter compute
        # saved went into waiting for the slow link, not into arriving early
        waited_med = peer_consensus(idx, w.waited_s[None, :]).median[0]
        hit &= ~(w.waited_s > np.maximum(waited_med, mean))
    for row in np.flatnonzero(hit):
        late[row] = True
        w.awaited_s[row] = max(w.awaited_s[row], float(mean[row]))
        w.awaited_k[row] = max(w.awaited_k[row], int(members[row]))
    window_rows = hit.copy()
    alpha = cfg.late_chance_per_step / max(n, 1)
    enough = seen & (steps * 2 >= cfg.late_window)
    for row in np.flatnonzero(enough & (times_last * members > steps)):  # above fair share
        need = min_count(int(steps[row]), int(members[row]), alpha)
        if times_last[row] >= need and not work_ratio[row] >= cfg.late_work_ratio:
            late[row] = True
            w.awaited_s[row] = max(w.awaited_s[row], float(max(corr[row], 0.0)))
            w.awaited_k[row] = max(w.awaited_k[row], int(members[row]))
    return late, window_rows


def _late_return(frame: StepFrame, w: Waits, state: NetworkState, cfg: NetworkConfig):
    """Rows still inside their collectives after every peer returned, step after step.

    The whole job is one comparison group: a late return is one-sided (the
    others had left), so even a rank whose groups have two members is told
    apart, by the ranks of every group. Windowed like the late arrivals.
    """
    n = frame.n
    held = w.held_s
    state.pending_held = held
    if held.shape[0] != n or not np.isfinite(held).any():
        return np.zeros(n, dtype=bool)
    count, usual = state.held.median(frame.rank, "held")
    usual = np.where(count >= cfg.history_min_steps, usual, np.nan)
    floor = excess_floor_s(frame, cfg)
    with np.errstate(invalid="ignore"):  # a return a floor later than usual does not teach
        state.held_quiet = ~(held - usual > floor)  # it: the baseline fills for 32 steps
    hit, mean, _ = late_residual_hits(
        state.job_peers.get(np.zeros(n, dtype=np.int64)), frame.rank, held, None, usual,
        state.held_window, floor_s=max(cfg.late_return_floor_s, floor),
        chance=cfg.chance_findings_per_step,
    )
    for row in np.flatnonzero(hit):
        w.awaited_s[row] = max(w.awaited_s[row], float(mean[row]))
        w.awaited_k[row] = max(w.awaited_k[row], n)
    return hit


def _job_comm_high(state: NetworkState, cfg: NetworkConfig) -> bool:
    """The job's comm_s (median of group medians) above its own clean history."""
    if state.pending_job is None:
        return False
    limit, _ = state.job.slow_limit(
        np.zeros(1, dtype=np.int64),
        "comm_s",
        ratio=cfg.history_ratio,
        k_sigma=4.0,
        min_count=cfg.history_min_steps,
    )
    return bool(state.pending_job > limit[0])


def _intersection(w: Waits, state: NetworkState, cfg: NetworkConfig, floor: float, rule) -> None:
    """SCOUT's rule: the rank in every collective slow inside and in no fast one.

    Slow inside: the instance's own duration (its shortest ``s``) above
    ``slow_ratio`` x its group's typical one, whoever arrived last. Once a
    rank is named, the other members of the slow instances spent that excess
    waiting for its link: it counts as their wait, so a cascade's late
    arrivers (who only waited in the slow ring) are victims, not roots.
    """
    slow_sets, fast_rows = [], set()
    for name, inside_s, rows in w.inside:
        ring = state.typical.get(name, [])
        base = float(np.median(ring)) if len(ring) >= cfg.history_min_steps else np.nan
        if not np.isfinite(base):
            continue
        if inside_s > cfg.slow_ratio * base and inside_s - base > floor:
            slow_sets.append((frozenset(rows.tolist()), inside_s - base))
        else:
            fast_rows.update(rows.tolist())
    if not slow_sets:
        return
    distinct = {s for s, _ in slow_sets}
    common = frozenset.intersection(*distinct) - fast_rows
    union = frozenset.union(*distinct)
    if len(distinct) < 2 or not common or len(common) * 2 >= len(union):
        return
    for members, excess in slow_sets:
        for row in members - common:
            w.waited_s[row] = max(w.waited_s[row], excess)
    excess = max(e for _, e in slow_sets)
    for row in common:
        w.awaited_s[row] = max(w.awaited_s[row], excess)
        w.awaited_k[row] = max(w.awaited_k[row], len(union))
        rule[row] = "cross_group_intersection"


def _from_comm_s(idx, c, cfg: NetworkConfig, floor: float, n: int):
    """No per-collective timings: the rank that waited far less than its peers was awaited."""
    comm, med = c.x[0], c.median[0]
    with np.errstate(invalid="ignore"):
        low = (c.z[0] < -cfg.z_min) & (med - comm > floor)
    low &= strict_majority(idx, low, c.count[0])[0]
    w = Waits(
        awaited_s=np.where(low, med - comm, 0.0),
        waited_s=np.zeros(n),
        awaited_in=low.astype(np.int64),
        awaited_k=np.where(low, c.count[0], 0).astype(np.int64),
        partners=[set() for _ in range(n)],
    )
    rule = np.full(n, "", dtype=object)
    rule[low] = "peer_comm_s"
    return w, rule


def _signal(frame, idx, c, w: Waits, state, row: int, rule: str, unattributed: bool) -> Signal:
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    _, hmed = state.history.median(frame.rank[row : row + 1], "comm_s")
    ranks = (int(frame.rank[row]),)
    step_s = step_reference_s(frame)  # the step as it was, the wait for this rank included
    awaited = float(w.awaited_s[row])
    slowdown = step_s / (step_s - awaited) if step_s > awaited > 0 else None
    if unattributed:
        ranks = tuple(sorted({ranks[0], *w.partners[row]}))
    return Signal(
        kind="network",
        ranks=ranks,
        detector=NAME,
        score=float(w.awaited_s[row]),
        severity="transient" if unattributed else "persistent",
        evidence=metric_evidence(
            "comm_s",
            c.x[0, row],
            c.median[0, row],
            c.x[0, peers],
            history_median=hmed[0],
            rule=rule,
            awaited_s=num(w.awaited_s[row]),
            own_wait_s=num(w.waited_s[row]),
            awaited_in=int(w.awaited_in[row]),
            compute_s=num(c.x[1, row]),
            compute_peer_median=num(c.median[1, row]),
            root_rank=int(frame.rank[row]),
            slowdown=num(slowdown),
        ),
        unattributed=unattributed,
    )


CONFIG = NetworkConfig
STATE = NetworkState

"""Often the slowest: a rank that is its group's slowest in most of its last steps.

Design notes: docs/detectors.md, "detectors/straggler/slowest_count.py". On a
crowded host one step's compute swings 20-50 % either way, and a few wild steps
inflate every spread the windowed test divides by, so a straggler of 1.25-1.5x
can hide from it for a whole run. Which rank is slowest is not moved by how
wild a step is: among ``n`` healthy peers each is slowest one step in ``n``, and
a rank slowest in 12 of 16 steps of a group of four is not chance. Named: a
count that chance reaches at most ``chance_findings_per_step`` a step over the
job's ranks, with a mean ratio of ``min_ratio`` and an excess over the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.gpu.readings import gpu_context, has_gpu, throttled
from rankscope.detectors.signal import Signal
from rankscope.detectors.stats.consensus import Z_CAP, excess_floor_s, frame_consensus
from rankscope.detectors.stats.level_shift import level_shift_back
from rankscope.detectors.stats.persistence import usable_ranks
from rankscope.detectors.stats.ring_state import dump_rings, load_rings
from rankscope.detectors.stats.slow_window import change_point_back

__all__ = ["SlowestCount", "SlowestResult", "count_needed", "slowest_hits", "slowest_signal"]

HOLD = 0.5  # a named rank stays named while slowest in this share of its readings, at
# this share of the ratio floor
MIN_PRESENT = 0.75  # of the window's steps, at least this share must hold a reading
WARMUP = 3  # a rank's first readings (compilation, caches) are not judged
RINGS = ("top", "lr", "ex", "ok")  # saved per step and rank
FLATS = ("pos", "seen")  # saved per rank
ONSET_TRIM = 2  # the onset is the run's third slowest step: two by chance do not start it


@lru_cache(maxsize=1024)
def count_needed(steps: int, size: int, rows: int, chance: float) -> int:
    """Fewest slowest-of-``size`` steps out of ``steps`` that chance alone crosses into
    at most ``chance / rows`` times a step (``steps + 1``: never).

    A count over a sliding window crosses up to ``k`` when the newest step is a
    slowest one, the step leaving the window was not, and the ``steps - 1``
    shared between them held ``k - 1``: the rate of new chance findings, not
    the (much larger, correlated) rate of windows over the count.
    """
    p = 1.0 / max(size, 2)
    limit = chance / max(rows, 1)
    for k in range(1, steps + 1):
        rate = math.comb(steps - 1, k - 1) * p**k * (1.0 - p) ** (steps - k + 1)
        if rate <= limit:
            return k
    return steps + 1


@dataclass(slots=True)
class SlowestResult:
    """Rows named this step and, for them, the window's figures."""

    hit: np.ndarray
    present: np.ndarray  # readings in the window
    count: np.ndarray  # of those, the steps it was its group's slowest
    ratio: np.ndarray  # mean compute over its reference (``rel``, the median) since the onset
    onset_back: np.ndarray  # how many of the last readings the slow run spans


class SlowestCount:
    """Per rank: a ring of whether it was its group's slowest, its log ratio to the
    group median and its excess in seconds, over the last ``steps`` steps."""

    __slots__ = ("steps", "top", "lr", "ex", "ok", "pos", "seen", "active")

    def __init__(self, steps: int) -> None:
        self.steps = max(int(steps), 1)
        self._reset(0)

    def _reset(self, n: int) -> None:
        w = self.steps
        self.top = np.zeros((w, n), dtype=bool)
        self.lr = np.zeros((w, n))
        self.ex = np.zeros((w, n))
        self.ok = np.zeros((w, n), dtype=bool)
        self.pos = np.zeros(n, dtype=np.int64)
        self.seen = np.zeros(n, dtype=np.int64)
        self.active = np.zeros(n, dtype=bool)

    def _grow(self, top: int) -> None:
        have = self.pos.shape[0]
        if top <= have:
            return
        old = {k: getattr(self, k) for k in RINGS}
        flat = {k: getattr(self, k) for k in (*FLATS, "active")}
        self._reset(max(top, 2 * have))
        for k, v in old.items():
            getattr(self, k)[:, :have] = v
        for k, v in flat.items():
            getattr(self, k)[:have] = v

    def push(self, ranks: np.ndarray, top: np.ndarray, lr: np.ndarray, ex: np.ndarray) -> None:
        """Record this step for ``ranks`` (NaN ``lr``: not judged this step)."""
        self._grow(int(ranks.max()) + 1)
        p = self.pos[ranks]
        have = np.isfinite(lr)
        self.top[p, ranks] = top & have
        self.lr[p, ranks] = np.where(have, lr, 0.0)
        self.ex[p, ranks] = np.where(have, ex, 0.0)
        self.ok[p, ranks] = have
        self.pos[ranks] = (p + 1) % self.steps

    def last(self, ranks: np.ndarray) -> np.ndarray:
        """Ring columns of each rank's readings, newest first."""
        return (self.pos[ranks][:, None] - 1 - np.arange(self.steps)[None, :]) % self.steps

    def state_dict(self) -> dict:
        return dump_rings(self, RINGS, FLATS)

    def load_state_dict(self, s: dict) -> None:
        load_rings(self, s, "slowest-count", RINGS, FLATS)


def slowest_hits(frame, idx, c, i: int, state: SlowestCount, cfg, skip: np.ndarray | None = None,
                 window=None, rel: np.ndarray | None = None) -> SlowestResult:  # fmt: skip
    """Advance the rings by this step (metric ``i`` of consensus ``c``); rows named now.
    ``skip``: rows whose step is no evidence (an expert rank busy with its tokens).
    ``rel``: each row's compute over what its peers predict for its batch, where every
    rank reports tokens (a long batch is slowest by right); else over the peer median.
    ``window``: the windowed test's ``SlowWindow``, whose change point over the same
    steps bounds the onset (the later of the two: onsets err late)."""
    n = frame.n
    x, med, size = c.x[i], c.median[i], c.count[i]
    ranks = frame.rank
    out = SlowestResult(np.zeros(n, dtype=bool), np.zeros(n, np.int64), np.zeros(n, np.int64),
                        np.full(n, np.nan), np.zeros(n, np.int64))  # fmt: skip
    u = np.flatnonzero(usable_ranks(ranks))  # rank ids that may index the rings
    if u.size == 0:
        return out
    state._grow(int(ranks[u].max()) + 1)
    seen = np.zeros(n, dtype=np.int64)
    seen[u] = state.seen[ranks[u]]
    with np.errstate(invalid="ignore", divide="ignore"):
        judged = np.isfinite(x) & (size >= 3) & (med > 0) & (seen >= WARMUP)
        judged &= usable_ranks(ranks)
        if skip is not None:
            judged &= ~skip
        ratio = x / med if rel is None else rel
        judged &= np.isfinite(ratio) & (ratio > 0)
        top = np.zeros(n, dtype=bool)
        rows_top, _ = idx.argmax_rows(ratio)  # a busy or young row still takes its place
        top[rows_top[rows_top >= 0]] = True
        lr = np.where(judged, np.log(ratio), np.nan)
        excess = x - x / ratio  # seconds over the reference
    state.seen[ranks[u]] += np.isfinite(x[u])
    state.push(ranks[u], top[u], lr[u], excess[u])
    held = np.zeros(n, dtype=bool)
    held[u] = state.active[ranks[u]]
    rows = np.flatnonzero((judged & top) | held)
    if rows.size == 0:
        return out
    cols = state.last(ranks[rows])
    rr = ranks[rows][:, None]
    ok, tops = state.ok[cols, rr], state.top[cols, rr]
    present, count = ok.sum(axis=1), tops.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mlr = state.lr[cols, rr].sum(axis=1) / present
        mex = state.ex[cols, rr].sum(axis=1) / present
    floor = excess_floor_s(frame, cfg)
    need = np.array([count_needed(int(p), int(s), n, cfg.chance_findings_per_step)
                     for p, s in zip(present, size[rows], strict=True)])  # fmt: skip
    fresh = ((present >= MIN_PRESENT * state.steps) & (count >= need)
             & (mlr >= math.log(cfg.min_ratio)) & (mex > floor))  # fmt: skip
    comm = frame.m.get("comm_s")
    if comm is not None and np.isfinite(comm).sum() >= 3:
        cc = frame_consensus(frame, idx, ("comm_s",))
        with np.errstate(invalid="ignore"):  # a victim waited longer than its peers
            fresh &= ~(cc.x[0, rows] > cc.median[0, rows])
    keep = held[rows] & (count >= HOLD * present) & (mlr > HOLD * math.log(cfg.min_ratio))
    hit = fresh | keep
    if has_gpu(frame):  # a throttling GPU is the GPU detector's finding, as in the window
        hit &= ~throttled(frame)[rows]
    state.active[ranks[rows]] = hit
    out.hit[rows] = hit
    out.present[rows], out.count[rows] = present, count
    if hit.any():
        h = np.flatnonzero(hit)
        p = 1.0 / np.maximum(size[rows[h]], 2)
        z = tops[h] - p[:, None]  # newest first; the run's oldest step must be a slowest one
        back = change_point_back(z, ok[h], tops[h])
        if window is not None:  # the windowed test's change point over them, when later
            back = np.minimum(back, window.onset_back(ranks[rows[h]], back))
        for j in range(back.size):  # a chance slowest step or two just before a fault
            tk = np.flatnonzero(tops[h][j, : back[j]])  # the run's slowest steps, newest first
            if tk.size > ONSET_TRIM:
                back[j] = tk[-1 - ONSET_TRIM] + 1
        lrs = np.where(ok[h], state.lr[cols[h], rr[h]], 0.0)
        back = level_shift_back(lrs, ok[h], back)  # a fault on top of a chance drift
        span = np.arange(state.steps)[None, :] < back[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            run = (lrs * span).sum(axis=1) / (ok[h] & span).sum(axis=1)
        out.onset_back[rows[h]] = back
        out.ratio[rows[h]] = np.exp(run)
    return out


def slowest_signal(frame, idx, c, i: int, res: SlowestResult, row: int, state, cfg) -> Signal:
    """A straggler signal for a row the slowest-count rule named."""
    metric = cfg.metrics[i]
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    _, hmed = state.history.median(frame.rank[row : row + 1], metric)
    present, count = int(res.present[row]), int(res.count[row])
    p = 1.0 / max(int(c.count[i, row]), 2)
    z = (count - present * p) / math.sqrt(max(present * p * (1.0 - p), 1e-9))
    gpu = gpu_context(frame, row)
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector="straggler",
        score=float(min(z, Z_CAP)),
        severity="persistent",
        evidence=metric_evidence(
            metric,
            c.x[i, row],
            c.median[i, row],
            c.x[i, peers],
            history_median=hmed[0],
            z=z,
            ratio=num(res.ratio[row]),
            rule="slowest_count",
            window_steps=present,
            slowest_steps=count,
            onset_step=int(frame.step) - int(res.onset_back[row]) + 1,
            slow_metrics=[metric],
            **({"gpu": gpu} if gpu else {}),
        ),
    )

"""Two peers, a sustained gap: the slower one named by how far and how long it trails.

Design notes: docs/detectors.md, "detectors/straggler/pair_gap.py". Two replicas
cannot outvote each other, and on a crowded host a slow one frees a core, so its
partner speeds up and its own history hides it; its gap to the partner does not.
Named: a gap of ``pair_gap_ratio`` held over ``pair_gap_steps`` steps, grown past
the pair's usual gap by a chance-rate z, with the partner waiting for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.gpu.readings import gpu_context
from rankscope.detectors.signal import Signal
from rankscope.detectors.stats.consensus import Z_CAP, excess_floor_s
from rankscope.detectors.stats.persistence import usable_ranks
from rankscope.detectors.stats.ring_state import dump_rings, load_rings
from rankscope.detectors.stats.robust import quantile_sorted
from rankscope.detectors.stats.slow_window import FOLLOW_EVERY, change_point_back, z_threshold
from rankscope.detectors.straggler.pair import other_member, pair_waits
from rankscope.detectors.straggler.window import HOLD

__all__ = ["PairGap", "PairGapResult", "pair_gap_hits", "pair_gap_signal"]

MIN_BASE = 8  # quiet clean steps before a usual gap judges (a spread of fewer is noise)
LEAST_GAP_SPREADS = 5.0  # a gap under pair_gap_ratio names where it is this many spreads
QUIET = 2  # a step teaches the usual gap only while the mean of this many is near it
SPREAD_FLOOR = 0.01  # log units: two ranks that never differ still jitter by this much
RINGS = ("d", "gap", "wait", "ok")  # saved per step and rank
FLATS = ("pos", "partner", "seen", "base_n")  # saved per rank


@dataclass(slots=True)
class PairGapResult:
    """Rows the rule names this step and, for them, the window's figures."""

    hit: np.ndarray
    z: np.ndarray
    ratio: np.ndarray  # mean compute over the partner's since the onset
    over_usual: np.ndarray  # the same over the usual ratio
    onset_back: np.ndarray  # how many of the last readings the slow run spans
    partner: np.ndarray  # the partner's row


class PairGap:
    """Per rank: a ring of its gaps to its partner, and its learnt usual gap."""

    __slots__ = ("steps", "history", "min_steps", "d", "gap", "wait", "ok", "sc", "pos", "partner",
                 "seen", "base", "base_s", "base_n", "usual", "spread", "active", "by_batch",
                 "quiet_spread", "pending")  # fmt: skip

    def __init__(self, steps: int, history: int, min_steps: int, ratio: float) -> None:
        self.steps = max(int(steps), 1)
        # a pair this quiet per median batch (``ratio``: pair_gap_ratio) is judged on
        # those readings alone
        self.quiet_spread = math.log(ratio) / LEAST_GAP_SPREADS
        self.history = int(history)
        self.min_steps = int(min_steps)  # a rank's first readings (warm-up) teach nothing
        self._reset(0)
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _reset(self, n: int) -> None:
        w = self.steps
        self.d = np.zeros((w, n))  # log compute ratio to the partner
        self.gap = np.zeros((w, n))  # compute seconds over the partner's
        self.wait = np.zeros((w, n))  # the partner's wait for it over the reverse (pair_waits)
        self.ok = np.zeros((w, n), dtype=bool)
        self.sc = np.zeros((w, n), dtype=bool)  # that reading per median batch
        self.pos = np.zeros(n, dtype=np.int64)
        self.partner = np.full(n, -1, dtype=np.int64)
        self.seen = np.zeros(n, dtype=np.int64)
        self.base = np.full((self.history, n), np.nan)
        self.base_s = np.zeros((self.history, n), dtype=bool)  # that reading per median batch
        self.base_n = np.zeros(n, dtype=np.int64)
        self.usual = np.full(n, np.nan)
        self.spread = np.full(n, np.nan)
        self.active = np.zeros(n, dtype=bool)
        self.by_batch = np.zeros(n, dtype=bool)  # usual gap, spread, window: per median batch

    def _grow(self, top: int) -> None:
        have = self.pos.shape[0]
        if top <= have:
            return
        old = {k: getattr(self, k) for k in ("d", "gap", "wait", "ok", "sc", "base",
                                              "base_s")}  # fmt: skip
        flat = {k: getattr(self, k) for k in ("pos", "partner", "seen", "base_n", "usual",
                                              "spread", "active", "by_batch")}  # fmt: skip
        self._reset(max(top, 2 * have))
        for k, v in old.items():
            getattr(self, k)[:, :have] = v
        for k, v in flat.items():
            getattr(self, k)[:have] = v

    def _forget(self, r: np.ndarray) -> None:
        """Ranks whose partner changed (a new layout): their gaps mean something else now."""
        self.ok[:, r] = False
        self.base[:, r] = np.nan
        self.base_s[:, r] = False
        self.base_n[r] = 0
        self.usual[r] = np.nan
        self.spread[r] = np.nan
        self.active[r] = False
        self.by_batch[r] = False
        self.seen[r] = 0

    def push(self, ranks, partners, d, gap, wait, scaled) -> None:
        """Record this step's readings (NaN ``d``: none; ``scaled``: per median batch)."""
        self._grow(int(max(ranks.max(), partners.max())) + 1)
        moved = self.partner[ranks] != partners
        if moved.any():
            self._forget(ranks[moved])
            self.partner[ranks[moved]] = partners[moved]
        p = self.pos[ranks]
        have = np.isfinite(d)
        self.d[p, ranks] = np.where(have, d, 0.0)
        self.gap[p, ranks] = np.where(have, gap, 0.0)
        self.wait[p, ranks] = np.where(np.isfinite(wait), wait, 0.0)
        self.ok[p, ranks] = have
        self.sc[p, ranks] = scaled
        self.pos[ranks] = (p + 1) % self.steps
        self.seen[ranks] += have

    def last(self, ranks: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ring columns of each rank's last ``k`` readings (newest first) and which hold one."""
        cols = (self.pos[ranks][:, None] - 1 - np.arange(k)[None, :]) % self.steps
        return cols, self.ok[cols, ranks[:, None]]

    def learn(self, clean: np.ndarray) -> None:
        """Teach the usual gap this step's reading of quiet, clean, unnamed ranks."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        rows, ranks, d, quiet, scaled = pending
        if clean.shape[0] <= int(rows.max(initial=-1)):
            return
        n = self.base_n[ranks]
        use = clean[rows] & quiet & ~self.active[ranks] & (self.seen[ranks] > self.min_steps)
        # readings per median batch replace raw ones as fast as the ring first filled
        ns = self.base_s[:, ranks].sum(axis=0)
        fill = scaled & (ns < self.history) & ((ns < MIN_BASE) | self.by_batch[ranks])
        use &= (n < self.history) | (self.seen[ranks] % FOLLOW_EVERY == 0) | fill
        if not use.any():
            return
        r = ranks[use]
        at = self.base_n[r] % self.history
        self.base[at, r] = d[use]
        self.base_s[at, r] = scaled[use]
        self.base_n[r] += 1
        self._summarize(r)

    def _summarize(self, r: np.ndarray) -> None:
        """The usual gap (median) and spread (RMS around it) of ranks ``r``'s rings; of
        their readings per median batch alone where ``MIN_BASE`` of them show a quiet
        pair. Raw compute of batches of +-50 % spread a quiet varlen pair's gap 0.2 wide
        (a real 0.017) and hid a 1.17x replica; a crowded host's pair keeps that width,
        its two replicas drift 1.3x apart for 12-20 steps now and then (docs/detectors.md)."""
        b = self.base[:, r].T  # rows: ranks; NaN where the ring is not full yet
        s = self.base_s[:, r].T & np.isfinite(b)
        ns = s.sum(axis=1)
        usual, spread = _usual(np.where(s, b, np.nan), ns)
        self.by_batch[r] = (ns >= MIN_BASE) & (spread < self.quiet_spread)
        usual_all, spread_all = _usual(b, np.minimum(self.base_n[r], self.history))
        self.usual[r] = np.where(self.by_batch[r], usual, usual_all)
        self.spread[r] = np.where(self.by_batch[r], spread, spread_all)

    def noise(self, rank: int) -> dict:
        """``noise`` for a signal on two peers: the learnt spread of the rank's log gap to its
        partner (both members' jitter, so more than one rank's: the report gate's yardstick
        errs towards waiting). Empty until the usual gap judges."""
        if rank >= self.base_n.shape[0] or self.base_n[rank] < MIN_BASE:
            return {}
        spread = float(self.spread[rank])
        return {"noise": num(spread)} if math.isfinite(spread) and spread > 0 else {}

    def state_dict(self) -> dict:
        out = dump_rings(self, RINGS, FLATS)
        out["base"] = [[None if not math.isfinite(v) else v for v in row]
                       for row in self.base.tolist()]  # fmt: skip
        out["base_s"] = [np.flatnonzero(row).tolist() for row in self.base_s]
        out["sc"] = [np.flatnonzero(row).tolist() for row in self.sc]
        return out

    def load_state_dict(self, s: dict) -> None:
        n = load_rings(self, s, "pair gap", RINGS, FLATS)
        if not n:
            return
        base = np.array(s["base"], dtype=object).reshape(self.history, n)
        base[base == None] = np.nan  # noqa: E711 (elementwise on an object array)
        self.base[:] = base.astype(np.float64)
        for ring, saved in ((self.base_s, s.get("base_s", [])), (self.sc, s.get("sc", []))):
            for i, cols in enumerate(saved[: ring.shape[0]]):
                ring[i, np.asarray(cols, dtype=np.int64)] = True
        self._summarize(np.flatnonzero(self.base_n > 0))


def _usual(b: np.ndarray, have: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``b`` (NaN: no reading): the median and RMS spread around it."""
    usual = quantile_sorted(np.sort(b, axis=1), have, 0.5)
    dev = np.where(np.isfinite(b), b - usual[:, None], 0.0)
    rms = np.sqrt(np.square(dev).sum(axis=1) / np.maximum(have, 1))
    return usual, np.maximum(rms, SPREAD_FLOOR)


def pair_gap_hits(frame, idx, x: np.ndarray, state: PairGap, cfg,
                  scaled: np.ndarray | None = None) -> PairGapResult:  # fmt: skip
    """Advance the pair gaps by this step (``x``: the windowed metric per row, per median
    batch where ``scaled``)."""
    n = frame.n
    out = PairGapResult(np.zeros(n, dtype=bool), np.full(n, np.nan), np.full(n, np.nan),
                        np.full(n, np.nan), np.zeros(n, dtype=np.int64),
                        np.full(n, -1, dtype=np.int64))  # fmt: skip
    rows = np.flatnonzero(idx.sizes[idx.row_gid] == 2)
    other = other_member(idx, rows)
    keep = usable_ranks(frame.rank[rows]) & usable_ranks(frame.rank[other])
    rows, other = rows[keep], other[keep]
    if rows.size == 0:
        return out
    ranks, partners = frame.rank[rows], frame.rank[other]
    gap = x[rows] - x[other]
    wait = pair_waits(frame, rows, other, gap)  # in the collectives the two share
    no_wait = wait is None
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = (x[rows] > 0) & (x[other] > 0)
        d = np.where(ok, np.log(x[rows] / x[other]), np.nan)
        if wait is None:
            wait = np.full(rows.size, np.nan)
    both = np.zeros(rows.size, dtype=bool) if scaled is None else scaled[rows] & scaled[other]
    state.push(ranks, partners, d, gap, wait, both)
    usual, spread = state.usual[ranks], state.spread[ranks]
    judged = state.base_n[ranks] >= MIN_BASE
    cols, have = state.last(ranks, state.steps)
    rc = ranks[:, None]
    by_batch = state.by_batch[ranks]
    have &= state.sc[cols, rc] | ~by_batch[:, None]  # like with like
    dd, gg, ww = state.d[cols, rc], state.gap[cols, rc], state.wait[cols, rc]
    k = have.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        recent = np.where(have[:, :QUIET], dd[:, :QUIET], 0.0).sum(axis=1) / np.maximum(
            have[:, :QUIET].sum(axis=1), 1)  # fmt: skip
        floor = math.log(cfg.pair_gap_ratio)
        mean_d = np.where(have, dd, 0.0).sum(axis=1) / np.maximum(k, 1)
        # until it judges, every clean step teaches; then only steps near the usual gap,
        # or any while the window's gap is under the usual by as much (narrower: not
        # this rank's slowness): a usual learnt in a lopsided warm-up must come down
        # to the pair's real gap, or only as wide a gap would ever teach it
        quiet = ~judged | (np.abs(recent - usual) < 0.5 * floor) | (mean_d < usual - 0.5 * floor)
        quiet |= both & (state.base_s[:, ranks].sum(axis=0) < MIN_BASE)  # their warm-up
        state.pending = (rows, ranks, d, quiet & np.isfinite(d), both)
        full = judged & (k * 4 >= 3 * state.steps)
        if not full.any():
            state.active[ranks] = False
            return out
        over = mean_d - usual
        z = np.clip((dd - usual[:, None]) / spread[:, None], -cfg.window_clip, cfg.window_clip)
        zsum = np.where(have, z, 0.0).sum(axis=1) / np.sqrt(np.maximum(k, 1))
        mgap = np.where(have, gg, 0.0).sum(axis=1) / np.maximum(k, 1)
        mwait = np.where(have, ww, 0.0).sum(axis=1) / np.maximum(k, 1)
        waited = (mwait >= cfg.lead_wait_frac * mgap) | no_wait
        limit = z_threshold(n, 1, cfg.chance_findings_per_step)
        grew = math.log(cfg.min_ratio)
        # and the gap costs the step what any slowness must (the detector's floors): a
        # 1.25x gap of 0.8 ms in a 9 ms step is a crowded host's doing (dp 2 tutorial)
        cost = excess_floor_s(frame, cfg)
        least = _least_gap(spread, floor, grew)
        fresh = (zsum > limit) & (mean_d > least) & (over > grew) & (mgap > cost)
        held = state.active[ranks] & (mean_d > HOLD * least) & (over > HOLD * grew)
        held &= mgap > HOLD * cost
        hit = full & waited & (fresh | held)
    state.active[ranks] = hit
    if hit.any():
        h = np.flatnonzero(hit)
        out.hit[rows[h]] = True
        out.z[rows[h]] = zsum[h]
        # the run's oldest readings must show the rule's own gap too: onsets err late
        back = change_point_back(z[h], have[h], dd[h] > least[h, None])
        run = have[h] & (np.arange(state.steps)[None, :] < back[:, None])
        run_d = np.where(run, dd[h], 0.0).sum(axis=1) / np.maximum(run.sum(axis=1), 1)
        out.ratio[rows[h]] = np.exp(run_d)  # over the shift: the slowdown to act on
        out.over_usual[rows[h]] = np.exp(run_d - usual[h])
        # the onset reported is no older than the newest readings that held the gap; one
        # under the floor but nearer the run's gap than the usual counts neither way (a
        # 1.25x replica's readings straddle the floor)
        mid = np.clip(0.5 * (usual[h] + run_d), grew, least[h])
        over = dd[h] > least[h, None]
        kept = _kept_run(over, have[h] & (over | (dd[h] <= mid[:, None])))
        out.onset_back[rows[h]] = np.minimum(back, kept)
        out.partner[rows[h]] = other[h]
    return out


def _least_gap(spread: np.ndarray, floor: float, grew: float) -> np.ndarray:
    """Per row, the log gap a pair must hold: ``pair_gap_ratio`` (``floor``) where the
    pair is noisy, down to ``min_ratio`` (``grew``, the groups' floor) where its learnt
    spread is ``LEAST_GAP_SPREADS`` times smaller. A crowded host's slow replica frees
    a core and its partner speeds up, so a 1.1x slowdown there reads a 1.2x gap; a quiet
    pair's gap is its slowdown, and a 1.17x replica held a steady 1.17x gap unnamed."""
    with np.errstate(invalid="ignore"):
        least = np.clip(LEAST_GAP_SPREADS * spread, grew, floor)
    return np.where(np.isfinite(least), least, floor)


def _kept_run(keep: np.ndarray, have: np.ndarray) -> np.ndarray:
    """Per row (readings newest first, ``have``: present and counted): how many of the
    newest readings the gap holds through. A reading without it is forgiven while the
    one before it holds it and misses stay at most a third of the run; two misses in a
    row end it. A clean pair on a crowded host drifts as far as a fault now and then:
    onsets err late, but not by the misses of a gap that holds (docs/detectors.md)."""
    out = np.ones(keep.shape[0], dtype=np.int64)
    for i in range(keep.shape[0]):
        seen, misses, last_missed = 0, 0, False
        for j in np.flatnonzero(have[i]):
            seen += 1
            if not keep[i, j]:
                if last_missed:
                    break
                misses, last_missed = misses + 1, True
                continue
            last_missed = False
            if 3 * misses <= seen:
                out[i] = j + 1
    return out


def pair_gap_signal(frame, x: np.ndarray, row: int, res: PairGapResult, state, cfg) -> Signal:
    """A straggler signal for a row the rule named (``state``: the straggler state)."""
    other = int(res.partner[row])
    _, hmed = state.history.median(frame.rank[row : row + 1], cfg.window_metric)
    back = int(res.onset_back[row])
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector="straggler",
        score=float(min(res.z[row], Z_CAP)) if np.isfinite(res.z[row]) else 0.0,
        severity="persistent",
        evidence=metric_evidence(
            cfg.window_metric,
            x[row],
            x[other],
            x[[other]],
            history_median=hmed[0],
            z=res.z[row],
            rule="pair_gap",
            ratio=num(res.ratio[row]),
            over_usual=num(res.over_usual[row]),
            window_steps=state.pair_gap.steps,
            onset_step=int(frame.step) - back + 1,
            slow_metrics=[cfg.window_metric],
            reason="two peers: it trailed its partner, well past their usual gap, for "
            f"{state.pair_gap.steps} steps, and the partner waited for it",
            **state.pair_gap.noise(int(frame.rank[row])),
            **({"gpu": g} if (g := gpu_context(frame, row)) else {}),
        ),
    )

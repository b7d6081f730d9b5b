"""Windowed slowness: a persistent excess that no single step can show.

Design notes: docs/detectors.md, "detectors/stats/slow_window.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np
from rankscope.detectors.stats.level_shift import level_shift_back
from rankscope.detectors.stats.persistence import usable_ranks
from rankscope.detectors.stats.robust import quantile_sorted

__all__ = ["SlowWindow", "WindowHits", "z_threshold", "change_point_back", "FOLLOW_EVERY"]

FOLLOW_EVERY = 16  # once a noise ring is full, it learns one clean step in this many
BASELINE_STRETCH = 5  # readings in a row with no excess in all that split a slow run


@lru_cache(maxsize=1024)
def z_threshold(rows: int, lengths: int, chance: float) -> float:
    """Normal quantile for ``chance`` chance findings per step over ``rows`` x ``lengths`` tests."""
    alpha = chance / max(rows * lengths, 1)
    return NormalDist().inv_cdf(1.0 - alpha)


def change_point_back(z: np.ndarray, ok: np.ndarray, keep: np.ndarray | None = None
                      ) -> np.ndarray:  # fmt: skip
    """Per row of ``z`` (readings newest first, ``ok`` where present): how many of the
    newest readings a slow run spans (``SlowWindow.onset_back``), its oldest reading
    at least the run's mean and, given ``keep``, kept by it, the one after it at least
    half the mean (a lone spike before a fault is noise), and no ``BASELINE_STRETCH``
    readings in it that sum to no excess (a chance episode before them is another
    one): onsets err late."""
    z = np.where(ok, z, 0.0)
    # the change point of a shift away from the baseline (z ~ 0 before it): the run
    # with the largest sum over the root of its length, the likelihood-ratio choice
    seen = np.cumsum(ok, axis=1)
    gain = np.where(seen > 0, np.cumsum(z, axis=1) / np.sqrt(np.maximum(seen, 1)), -np.inf)
    back = np.argmax(gain, axis=1) + 1
    # a stretch inside the run that looks like the baseline (BASELINE_STRETCH readings
    # summing to no excess) ends it: what came before is another, earlier episode
    k = BASELINE_STRETCH
    if z.shape[1] >= k:
        # per start j: the sum of readings j..j+k-1, and whether all k are present
        flat = (_stretch_sums(z, k) <= 0.0) & (_stretch_sums(ok.astype(float), k) == k)
        for i in range(back.size):
            inside = np.flatnonzero(flat[i, : max(back[i] - k + 1, 0)])
            if inside.size and inside[0] >= 1:
                back[i] = inside[0]
    # the oldest step of the run must look like the run (z at least its mean):
    # one noisy step just before a fault is not its onset
    for i in range(back.size):
        while back[i] > 1:
            run = z[i, : back[i]][ok[i, : back[i]]]
            oldest = back[i] - 1
            mean = run.mean() if run.size else 0.0
            nxt = oldest - 1  # and the one after it half as much: a lone spike is noise
            if (keep is None or keep[i, oldest]) and z[i, oldest] >= mean and (
                not ok[i, nxt] or z[i, nxt] >= 0.5 * mean
            ):
                break
            back[i] -= 1
    return back


def _stretch_sums(a: np.ndarray, k: int) -> np.ndarray:
    """Per row, the sums of every ``k`` consecutive columns (one per start column)."""
    c = np.concatenate([np.zeros((a.shape[0], 1)), np.cumsum(a, axis=1)], axis=1)
    return c[:, k:] - c[:, :-k]


@dataclass(slots=True)
class WindowHits:
    """Per row: the best window's z (NaN where not judged) and its length (0: not asked).

    Lengths cost a pass over every window, so ``update`` leaves them at 0; callers
    fill them for the few rows they look at with ``SlowWindow.qualify``.
    """

    z: np.ndarray
    steps: np.ndarray


class SlowWindow:
    """Per-rank rings of standardized log ratios, and per-group noise baselines."""

    __slots__ = (
        "lengths",
        "clip",
        "history",
        "min_steps",
        "size",
        "zr",
        "lr",
        "ex",
        "ok",
        "pos",
        "sums",
        "counts",
        "lr_sums",
        "ex_sums",
        "odd",
        "keys",
        "sig",
        "zvar",
        "sig_n",
        "var_n",
        "pending",
        "active",
    )

    def __init__(
        self, lengths: tuple[int, ...], *, clip: float, history: int, min_steps: int
    ) -> None:
        self.lengths = tuple(sorted(int(w) for w in lengths))
        self.clip = float(clip)
        self.history = int(history)
        self.min_steps = int(min_steps)
        self.size = self.lengths[-1]
        self._reset_ranks(0)
        self.keys = np.zeros(0, dtype=np.int64)
        self.sig = np.full((0, self.history), np.nan)
        self.zvar = np.full((0, self.history), np.nan)
        self.sig_n = np.zeros(0, dtype=np.int64)
        self.var_n = np.zeros(0, dtype=np.int64)
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _reset_ranks(self, n: int) -> None:
        self.zr = np.zeros((self.size, n))  # slot-major: one step's slot is contiguous
        self.lr = np.zeros((self.size, n))
        self.ex = np.zeros((self.size, n))
        self.ok = np.zeros((self.size, n))  # 1.0 where the slot holds a reading
        self.pos = np.zeros(n, dtype=np.int64)
        self.active = np.zeros(n, dtype=bool)  # named by the test, not yet cleared
        self.sums = np.zeros((len(self.lengths), n))
        self.counts = np.zeros((len(self.lengths), n))
        # per window length, the sums of lr and ex over it (``means`` without a gather),
        # of finite readings only; ``odd`` counts the others (``means`` gathers those ranks)
        self.lr_sums = np.zeros((len(self.lengths), n))
        self.ex_sums = np.zeros((len(self.lengths), n))
        self.odd = np.zeros((len(self.lengths), n))

    def _grow(self, top: int) -> None:
        have = self.pos.shape[0]
        if top <= have:
            return
        new = max(top, 2 * have)
        old = (
            self.zr,
            self.lr,
            self.ex,
            self.ok,
            self.pos,
            self.sums,
            self.counts,
            self.active,
            self.lr_sums,
            self.ex_sums,
            self.odd,
        )
        self._reset_ranks(new)
        self.zr[:, :have], self.lr[:, :have], self.ex[:, :have] = old[:3]
        self.ok[:, :have] = old[3]
        self.pos[:have] = old[4]
        self.sums[:, :have], self.counts[:, :have] = old[5], old[6]
        self.active[:have] = old[7]
        self.lr_sums[:, :have], self.ex_sums[:, :have], self.odd[:, :have] = old[8:]

    # -- noise baseline per group (learnt from clean steps only) --

    def _ref(self, keys: np.ndarray, ring: np.ndarray, filled: np.ndarray, how: str) -> np.ndarray:
        out = np.full(keys.shape[0], np.nan)
        if not np.array_equal(keys, self.keys):
            return out
        enough = filled >= self.min_steps
        if enough.any():
            sub = ring[enough]
            if how == "median":  # np.nanmedian goes through masked arrays: slow when small
                have = np.isfinite(sub).sum(axis=1)
                out[enough] = quantile_sorted(np.sort(sub, axis=1), have, 0.5)
            else:
                out[enough] = np.nanmean(sub, axis=1)
        return out

    def standardize(
        self, idx, dev: np.ndarray, count: np.ndarray, rel_sigma: np.ndarray, *, raw=False
    ):
        """Per row: centered, clipped z of ``dev`` (deviation from the peer median) and its scale.

        ``dev`` over the group's reference sigma, clipped to +-clip, then less the
        group's mean clipped z: for skewed noise (arrival jitter is exponential-like)
        the median is not the mean, and summing steps would add up that gap. The
        scale is the learnt standard deviation of these z in clean steps (robust
        sigmas understate a skewed spread), so a window's sum over ``sqrt(w) x
        scale`` is standard normal under no fault. Also offers this step's
        statistics for ``learn``. With ``raw``, also the same z unclipped (one
        step's own evidence, for a per-step test), as a third value, and the
        learnt sigma it divides by as a fourth.
        """
        sigma = idx.rows(self._ref(idx.keys, self.sig, self.sig_n, "median"))
        with np.errstate(invalid="ignore", divide="ignore"):
            unclipped = np.where(count >= 3, dev / sigma, np.nan)
            z = np.clip(unclipped, -self.clip, self.clip)
            mat = idx.matrix(z)
            have = np.isfinite(mat).any(axis=1)
            centre = np.zeros(idx.n_groups)
            centre[have] = np.nanmean(mat[have], axis=1)
            centre_rows = idx.rows(centre)
            z = z - centre_rows
            var_g = np.full(idx.n_groups, np.nan)
            var_g[have] = np.nanmean(np.square(mat[have] - centre[have, None]), axis=1)
        scale = np.sqrt(idx.rows(self._ref(idx.keys, self.zvar, self.var_n, "mean")))
        self.pending = (np.asarray(idx.keys, dtype=np.int64).copy(), rel_sigma, var_g)
        if raw:
            return z, scale, unclipped - centre_rows, sigma
        return z, scale

    def learn(self, clean_frac: float, step: int) -> None:
        """Keep this step's group statistics if the step was mostly clean.

        Rings fill from the first clean steps, then follow one step in
        ``FOLLOW_EVERY``: a slow rank that nobody named yet sits in its own
        group's spread, and must not teach the group that it is noisy.
        """
        pending, self.pending = self.pending, None
        if pending is None or clean_frac < 0.5:  # a troubled step teaches nothing
            return
        keys, rel, var = pending
        if not np.array_equal(keys, self.keys):  # new layout: start over
            self.keys = keys
            self.sig = np.full((keys.shape[0], self.history), np.nan)
            self.zvar = np.full((keys.shape[0], self.history), np.nan)
            self.sig_n = np.zeros(keys.shape[0], dtype=np.int64)
            self.var_n = np.zeros(keys.shape[0], dtype=np.int64)
        follow = step % FOLLOW_EVERY == 0
        for ring, filled, v in ((self.sig, self.sig_n, rel), (self.zvar, self.var_n, var)):
            rows = np.flatnonzero(np.isfinite(v) & (v > 0) & (follow | (filled < self.history)))
            ring[rows, filled[rows] % self.history] = v[rows]
            filled[rows] += 1

    # -- evidence per rank (advanced by detect, like a streak counter) --

    def update(self, ranks, z, log_ratio, excess_s, scale) -> WindowHits:
        """Push this step's readings (NaN z: no reading) and return the best window per row."""
        ranks = np.asarray(ranks, dtype=np.int64)
        n = ranks.shape[0]
        out = WindowHits(z=np.full(n, np.nan), steps=np.zeros(n, dtype=np.int64))
        use = usable_ranks(ranks)
        if not use.any():
            return out
        every = bool(use.all())
        r = ranks if every else ranks[use]
        self._grow(int(r.max()) + 1)
        if every and r[0] == 0 and r[-1] == n - 1 and self.pos[0] == self.pos[n - 1]:
            if np.all(self.pos[:n] == self.pos[0]):  # the usual step: one slot for everyone
                r = slice(0, n)
        sub = (lambda a: a) if every else (lambda a: a[use])
        zz = sub(z)
        valid = np.isfinite(zz)
        znew = np.where(valid, np.clip(zz, -self.clip, self.clip), 0.0)
        p = self.pos[r] if not isinstance(r, slice) else int(self.pos[0])
        cols = r if not isinstance(r, slice) else np.s_[r]
        vf = valid.astype(np.float64)
        lrnew = np.where(valid, sub(log_ratio), 0.0)
        exnew = np.where(valid, sub(excess_s), 0.0)
        lr_f, ex_f, odd = _finite_parts(lrnew, exnew)
        for i, w in enumerate(self.lengths):  # slide every window by one reading
            old = (p - w) % self.size  # empty slots hold z = 0, ok = 0
            self.sums[i, cols] += znew - self.zr[old, cols]
            self.counts[i, cols] += vf - self.ok[old, cols]
            o_lr, o_ex, o_odd = _finite_parts(self.lr[old, cols], self.ex[old, cols])
            self.lr_sums[i, cols] += lr_f - o_lr
            self.ex_sums[i, cols] += ex_f - o_ex
            self.odd[i, cols] += odd - o_odd
        self.zr[p, cols] = znew
        self.lr[p, cols] = lrnew
        self.ex[p, cols] = exnew
        self.ok[p, cols] = vf
        self.pos[r] = (p + 1) % self.size
        best = np.full(zz.shape[0], -np.inf)
        zw = np.empty(zz.shape[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            for i, w in enumerate(self.lengths):
                cnt = self.counts[i, cols]
                zw.fill(-np.inf)  # at most a quarter of the window may be missing
                np.divide(self.sums[i, cols], np.sqrt(cnt), out=zw, where=cnt * 4 >= 3 * w)
                np.maximum(best, zw, out=best)
            best /= sub(scale)
        best[~np.isfinite(best)] = np.nan
        steps = np.zeros(zz.shape[0], dtype=np.int64)  # filled by qualify where needed
        if every:
            out.z, out.steps = best, steps
        else:
            out.z[use], out.steps[use] = best, steps
        return out

    def hold(self, ranks: np.ndarray) -> None:
        """Name ``ranks`` as if the windows had (another rule confirmed them)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        ranks = ranks[usable_ranks(ranks)]
        if ranks.size:
            self._grow(int(ranks.max()) + 1)
            self.active[ranks] = True

    def qualify(self, ranks, scale, held, limit: float, floors, hold_floors=None):
        """Per rank: the shortest window whose z clears ``limit`` and that ``floors`` accepts.

        ``floors(mean_log_ratio, mean_excess) -> bool array`` is the caller's
        absolute test. A ``held`` rank (already named) qualifies on its longest
        window by the floors alone, and, given ``hold_floors`` (the caller's
        laxer test: hysteresis), on its shortest window by those: just after
        the onset the long windows still hold the steps before it, and a rank
        confirmed by its first slow steps must not drop out on the next
        middling one. Returns (ok, window length, mean log ratio,
        mean excess, window z), NaN / 0 where no window qualifies.
        """
        ranks = np.asarray(ranks, dtype=np.int64)
        k = ranks.shape[0]
        ok = np.zeros(k, dtype=bool)
        steps = np.zeros(k, dtype=np.int64)
        lr, ex, zs = np.full(k, np.nan), np.full(k, np.nan), np.full(k, np.nan)
        for i, w in enumerate(self.lengths):
            cnt = self.counts[i, ranks]
            with np.errstate(invalid="ignore", divide="ignore"):
                zw = np.where(cnt * 4 >= 3 * w, self.sums[i, ranks] / np.sqrt(cnt), np.nan)
                zw = zw / scale
            m_lr, m_ex = self.means(ranks, np.full(k, w))
            longest = w == self.lengths[-1]
            with np.errstate(invalid="ignore"):
                good = ((zw > limit) | (held & longest)) & floors(m_lr, m_ex)
                if hold_floors is not None and w == self.lengths[0]:
                    good |= held & hold_floors(m_lr, m_ex)
                good &= ~ok
            steps[good], lr[good], ex[good], zs[good] = w, m_lr[good], m_ex[good], zw[good]
            ok |= good
        return ok, steps, lr, ex, zs

    def onset_back(self, ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Per rank: how many of its last ``steps`` readings the evidence run spans.

        A window that names a rank usually starts before the slowness did (the
        shortest window that clears the limit is 4 steps, the slowness may be
        2 steps old). The onset is the likelihood-ratio change point for a shift
        away from the baseline (z ~ 0 before it): the start of the newest run with
        the largest z sum over the root of its length, then trimmed while its
        oldest step's z is below the run's mean or the next one's below half of
        it: onsets err late, not early. (A sum less half the window's mean z per
        step, the CUSUM choice, let one noisy clean step ten steps before a fault
        pull the onset back to it.)
        """
        ranks = np.asarray(ranks, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        out = np.maximum(steps, 1)
        for w in np.unique(steps):
            sel = np.flatnonzero(steps == w)
            if w <= 1 or sel.size == 0:
                continue
            rc, cols, ok = self._last(ranks[sel], int(w))
            back = change_point_back(self.zr[cols, rc], ok)
            out[sel] = level_shift_back(self.lr[cols, rc], ok, back)  # a fault on a drift
        return out

    def _last(self, r: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ranks ``r``: ``r`` as a column, the ring columns of their last ``w``
        readings (newest first) and which of those hold a reading."""
        rc = r[:, None]
        cols = (self.pos[rc] - 1 - np.arange(w)[None, :]) % self.size
        return rc, cols, self.ok[cols, rc] > 0

    def means(self, ranks: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean log ratio, mean excess seconds) over each rank's last ``steps`` readings."""
        ranks = np.asarray(ranks, dtype=np.int64)
        lr = np.full(ranks.shape[0], np.nan)
        ex = np.full(ranks.shape[0], np.nan)
        for w in np.unique(steps):
            sel = np.flatnonzero(steps == w)
            if w <= 0 or sel.size == 0:
                continue
            if w in self.lengths:  # the running sums, where every reading is finite
                i = self.lengths.index(w)
                r = ranks[sel]
                k = np.maximum(self.counts[i, r], 1)
                lr[sel] = self.lr_sums[i, r] / k
                ex[sel] = self.ex_sums[i, r] / k
                sel = sel[self.odd[i, r] > 0]
                if sel.size == 0:
                    continue
            rc, cols, ok = self._last(ranks[sel], int(w))
            k = np.maximum(ok.sum(axis=1), 1)
            lr[sel] = np.where(ok, self.lr[cols, rc], 0.0).sum(axis=1) / k
            ex[sel] = np.where(ok, self.ex[cols, rc], 0.0).sum(axis=1) / k
        return lr, ex

    def _rebuild_means(self) -> None:
        """The running lr / ex sums from the rings (they are not saved: derived)."""
        n = self.pos.shape[0]
        r = np.arange(n)
        for i, w in enumerate(self.lengths):
            rc, cols, _ok = self._last(r, w)
            lr_f, ex_f, odd = _finite_parts(self.lr[cols, rc], self.ex[cols, rc])
            self.lr_sums[i], self.ex_sums[i], self.odd[i] = (
                lr_f.sum(axis=1),
                ex_f.sum(axis=1),
                odd.sum(axis=1),
            )

    def state_dict(self) -> dict:
        def fl(a):
            return [[None if not math.isfinite(v) else v for v in row] for row in a.tolist()]

        return {
            "lengths": list(self.lengths),
            "zr": self.zr.tolist(),
            "lr": self.lr.tolist(),
            "ex": self.ex.tolist(),
            "ok": self.ok.astype(np.int8).tolist(),
            "pos": self.pos.tolist(),
            "active": np.flatnonzero(self.active).tolist(),
            "sums": self.sums.tolist(),
            "counts": self.counts.tolist(),
            "keys": self.keys.tolist(),
            "sig": fl(self.sig),
            "zvar": fl(self.zvar),
            "sig_n": self.sig_n.tolist(),
            "var_n": self.var_n.tolist(),
        }

    def load_state_dict(self, d: dict) -> None:
        if not d:
            return
        if tuple(d.get("lengths", ())) != self.lengths:
            raise ValueError(f"window state has lengths {d.get('lengths')}, not {self.lengths}")
        n = len(d["pos"])
        self._reset_ranks(n)
        if n:
            self.zr[:] = np.asarray(d["zr"], float).reshape(self.size, n)
            self.lr[:] = np.asarray(d["lr"], float).reshape(self.size, n)
            self.ex[:] = np.asarray(d["ex"], float).reshape(self.size, n)
            self.ok[:] = np.asarray(d["ok"], float).reshape(self.size, n)
            self.pos[:] = np.asarray(d["pos"], np.int64)
            self.active[np.asarray(d.get("active", []), dtype=np.int64)] = True
            self.sums[:] = np.asarray(d["sums"], float).reshape(len(self.lengths), n)
            self.counts[:] = np.asarray(d["counts"], float).reshape(len(self.lengths), n)
            self._rebuild_means()
        self.keys = np.asarray(d.get("keys", []), dtype=np.int64)
        g = self.keys.shape[0]
        sig = np.array(d.get("sig", []), dtype=object).reshape(g, self.history)
        sig[sig == None] = np.nan  # noqa: E711 (elementwise on an object array)
        self.sig = sig.astype(np.float64)
        zvar = np.array(d.get("zvar", []), dtype=object).reshape(g, self.history)
        zvar[zvar == None] = np.nan  # noqa: E711
        self.zvar = zvar.astype(np.float64)
        self.sig_n = np.asarray(d.get("sig_n", []), dtype=np.int64)
        self.var_n = np.asarray(d.get("var_n", []), dtype=np.int64)


def _finite_parts(lr: np.ndarray, ex: np.ndarray):
    """(lr, ex) with 0 where either is not finite, and 1.0 there (the running sums' parts)."""
    fin = np.isfinite(lr) & np.isfinite(ex)
    if fin.all():
        return lr, ex, np.zeros(lr.shape)
    return np.where(fin, lr, 0.0), np.where(fin, ex, 0.0), (~fin).astype(np.float64)

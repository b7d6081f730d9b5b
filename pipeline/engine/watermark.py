"""Event-time watermark of one job: up to which record time ``t`` has everything arrived.

The online service reads records in arrival order, and arrival order is not
time order: ranks' records travel separately (a trace published one file at
a time is the extreme case), GPU samples come on their own topic. Deciding
"step overdue" or "rank silent" on the wall clock then sees ranks missing
that only came late. The watermark decides on record time instead: every
rank that is reporting has reached at least ``W``, so nothing older than
``W`` is still on its way, and a step is overdue once ``W`` is a deadline
past it, exactly as replay (sorted by ``t``) decides on its record clock.

The wall clock only says when to stop waiting for someone: a rank that sent
nothing for ``stall_s`` wall seconds (crashed, hung without beats, or not
started yet) no longer holds ``W`` back, and a job that sent nothing for that
long has delivered what it will (``W`` becomes its latest ``t``).

The records watermark (what the hang monitor goes by) also lets silence count:
a rank's records come in order, within ``DELIVERY_S`` of their time, so one
that sent nothing for ``q`` wall seconds has sent nothing up to its latest
``t + q - DELIVERY_S`` either (an idle source's watermark goes on). A dead
rank then looks silent on the monitor's clock as the wall clock runs, not
only once ``stall_s`` has passed, and a job that fell wholly silent has its
silence measured instead of its clock standing still at its last record.

Two watermarks per job: over ``step``/``check`` records (step deadlines, the
same records the replay clock uses) and over every rank-stamped record,
beats included (the hang monitor, whose beats keep coming while steps stop).
GPU samples have a third, per (host, gpu) source: a complete step waits until
the samples up to its time have come, so the GPU join sees what replay sees.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Watermark", "DELIVERY_S"]

_NEG = -math.inf
DELIVERY_S = 1.0
"""Longest a record takes from its rank (its time ``t``) to ``serve``: the collector
sends every 0.2 s and flushes every 1 s, Kafka adds its linger. Silence counts on the
records watermark only beyond this."""


class Watermark:
    """Per-rank latest record time and arrival of one job (kept by the step assembler)."""

    __slots__ = ("step_t", "any_t", "wall", "first_wall", "last_wall", "gpu", "_step_w", "_any_w")

    def __init__(self) -> None:
        self.step_t = np.full(0, _NEG)  # latest t of the rank's step/check records
        self.any_t = np.full(0, _NEG)  # latest t of any record of the rank
        self.wall = np.full(0, _NEG)  # the rank's last arrival (wall clock)
        self.first_wall = _NEG
        self.last_wall = _NEG
        self.gpu: dict[tuple, list[float]] = {}  # (host, gpu) -> [latest t, last arrival]
        self._step_w = _NEG  # watermarks never go back
        self._any_w = _NEG

    def _grow(self, size: int) -> None:
        if self.wall.size < size:
            extra = max(size, 2 * self.wall.size) - self.wall.size
            pad = np.full(extra, _NEG)
            self.step_t = np.concatenate([self.step_t, pad])
            self.any_t = np.concatenate([self.any_t, pad])
            self.wall = np.concatenate([self.wall, pad])

    def _arrived(self, now: float) -> None:
        if self.first_wall == _NEG:
            self.first_wall = now
        self.last_wall = max(self.last_wall, now)

    def rank(self, rank: int, t, now: float, *, step: bool) -> None:
        """One record of ``rank`` with time ``t`` arrived at ``now``."""
        self._arrived(now)
        if rank < 0:
            return
        self._grow(rank + 1)
        self.wall[rank] = now
        if t is None or not t == t:  # None or NaN: an arrival, no time
            return
        if t > self.any_t[rank]:
            self.any_t[rank] = t
        if step and t > self.step_t[rank]:
            self.step_t[rank] = t

    def ranks(self, rank: np.ndarray, t: np.ndarray, now: float) -> None:
        """Step records as columns (ranks already checked to be in range)."""
        if rank.size == 0:
            return
        self._arrived(now)
        self._grow(int(rank.max()) + 1)
        self.wall[rank] = now
        ok = ~np.isnan(t)
        np.maximum.at(self.step_t, rank[ok], t[ok])
        np.maximum.at(self.any_t, rank[ok], t[ok])

    def gpu_sample(self, key: tuple, t, now: float) -> None:
        self._arrived(now)
        got = self.gpu.get(key)
        if got is None:
            got = self.gpu[key] = [_NEG, now]
        if t is not None and t > got[0]:
            got[0] = float(t)
        got[1] = now

    def _min_live(self, which: str, world: int, now: float, stall_s: float, latest: float,
                  silence: bool = False) -> float:  # fmt: skip
        quiet = now - self.last_wall
        if quiet > stall_s:  # the job went quiet: everything it sent is here
            return latest + max(0.0, quiet - DELIVERY_S) if silence else latest
        self._grow(world)
        times = getattr(self, which)[:world]  # after growing: the arrays are replaced
        wall = self.wall[:world]
        live = wall >= now - stall_s
        if now - self.first_wall <= stall_s:
            live |= wall == _NEG  # not heard from yet, but the job just began
        if not live.any():
            return latest
        times, wall = times[live], wall[live]
        if silence:  # nothing of a rank's is on its way that is older than its silence
            heard = wall > _NEG
            times = times.copy()
            times[heard] += np.maximum(0.0, now - wall[heard] - DELIVERY_S)
        return float(times.min())

    def steps(self, world: int, now: float, stall_s: float, latest: float) -> float:
        """Record time up to which every live rank's step records are in."""
        w = self._min_live("step_t", world, now, stall_s, latest)
        self._step_w = max(self._step_w, w)
        return self._step_w

    def records(self, world: int, now: float, stall_s: float, latest: float) -> float:
        """Record time up to which every live rank's records (beats too) are in, or by
        its silence cannot be (``DELIVERY_S``): may run past the latest ``t``."""
        w = self._min_live("any_t", world, now, stall_s, latest, silence=True)
        self._any_w = max(self._any_w, w)
        return self._any_w

    def gpu_done(self, until_t: float, now: float, stall_s: float) -> bool:
        """Have the GPU samples up to ``until_t`` come (or their sources gone quiet)?"""
        for t, wall in self.gpu.values():
            if t < until_t and now - wall <= stall_s:
                return False
        return True

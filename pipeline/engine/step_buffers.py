"""What the step assembler keeps per job and per open step (``rankscope.pipeline.engine.assemble``).

An open step holds its records as they came: dicts from the record path (sealed
into one column chunk when the step is built or when a columnar batch follows
them, so arrival order holds) and column chunks from the columnar paths, plus
one flag byte a rank, so counting, duplicates and missing ranks are array
operations.
"""

from __future__ import annotations

import math
from collections import Counter, deque

import numpy as np
from rankscope.pipeline.engine.columns import PeerGroups, chunk_from_records
from rankscope.pipeline.engine.gpu_join import GpuJoin
from rankscope.pipeline.engine.watermark import Watermark
from rankscope.pipeline.engine.world_vote import WorldVote

__all__ = ["Pending", "JobBuffer", "LOSS_COUNTS", "loss_counts"]

LOSS_COUNTS = ("late", "forced", "partial_frames", "refused", "dropped")
"""What a job lost, as the store's ``jobs`` table and ``rankscope findings`` show it:
records of steps already built (``late``), steps built before they were complete to
bound memory (``forced``), steps built with ranks missing (``partial_frames``),
records the assembler refused for the job's bounds (``refused``: outside the world,
world mismatch, t or step too far ahead, steps that could not be built), and records
the collectors said they had to drop (``dropped``)."""
_REFUSALS = ("refused", "world_mismatch", "t_ahead", "ahead", "build_errors")


def loss_counts(stats) -> dict[str, int]:
    """``LOSS_COUNTS`` of one job from the assembler's counters."""
    out = {k: int(stats.get(k, 0)) for k in ("late", "forced", "partial_frames", "dropped")}
    out["refused"] = sum(int(stats.get(k, 0)) for k in _REFUSALS)
    return out


class Pending:
    """The records of one step seen so far."""

    __slots__ = ("step", "opened", "flags", "seen", "count", "chunks", "recs", "checks", "t_hi")

    def __init__(self, step: int, opened: float, world: int) -> None:
        self.step = step
        self.opened = opened
        # one byte per rank; a bytearray is fast to index from Python (dict path) and
        # ``seen`` is a numpy view of the same memory for whole-array marks (columnar path)
        self.flags = bytearray(world)
        self.seen = np.frombuffer(self.flags, dtype=bool)
        self.count = 0
        self.chunks: list[dict] = []
        self.recs: list[dict] = []
        self.checks: list[dict] = []
        self.t_hi = -math.inf  # latest t of its step records (event clock: the GPU join waits)

    def grow(self, world: int) -> None:
        if len(self.flags) < world:
            self.flags = self.flags + bytearray(world - len(self.flags))
            self.seen = np.frombuffer(self.flags, dtype=bool)

    def mark(self, ranks: np.ndarray, world: int) -> None:
        self.grow(world)
        self.seen[ranks] = True

    def seal(self) -> None:
        if self.recs:
            self.chunks.append(chunk_from_records(self.recs))
            self.recs = []


class JobBuffer:
    """One job: its open steps, clocks, recent step times, counters, GPU join and hosts."""

    __slots__ = (
        "name", "world", "pending", "last_emitted", "clock", "step_clock", "durations", "prev_t",
        "stats", "gpu", "groups", "hosts", "vote", "mark",
    )  # fmt: skip

    def __init__(self, name: str, recent: int) -> None:
        self.name = name
        self.world = 0
        self.pending: dict[int, Pending] = {}
        self.last_emitted: int | None = None
        self.clock = -math.inf  # latest t of any record (hang checks)
        self.step_clock = -math.inf  # latest t of step/check records (step deadlines)
        self.durations: deque[float] = deque(maxlen=recent)
        self.prev_t = math.nan
        self.stats: Counter = Counter()
        self.gpu = GpuJoin()
        self.groups = PeerGroups()
        self.hosts = np.full(0, None, dtype=object)
        self.vote = WorldVote()  # which world the job's ranks claim (world_vote.py)
        self.mark = Watermark()  # event clock only

    def learn_duration(self, frame) -> None:
        """The step time of a built frame (its median ``step_s``, else the gap in ``t``)."""
        step_s = frame.m["step_s"]
        t = frame.t
        dur = math.nan
        if np.isfinite(step_s).any():
            dur = float(np.nanmedian(step_s))
        elif math.isfinite(self.prev_t) and math.isfinite(t) and t > self.prev_t:
            dur = t - self.prev_t
        if math.isfinite(dur) and dur > 0:
            self.durations.append(dur)
        if math.isfinite(t):
            self.prev_t = t

    def state_dict(self) -> dict:
        """What outlives a restart (``StepAssembler.state_dict``); open steps do not."""
        return {
            "world": self.world,
            "world_settled": self.vote.settled,
            "last_emitted": self.last_emitted,
            "durations": list(self.durations),
            "prev_t": self.prev_t if math.isfinite(self.prev_t) else None,
            "hosts": [h for h in self.hosts.tolist()],
        }

    def load_state_dict(self, s: dict) -> None:
        self.world = int(s.get("world", 0))
        self.vote = WorldVote(self.world, bool(s.get("world_settled", self.world > 0)))
        self.last_emitted = s.get("last_emitted")
        self.durations.extend(float(x) for x in s.get("durations", []))
        prev = s.get("prev_t")
        self.prev_t = float(prev) if prev is not None else math.nan
        self.hosts = np.array(list(s.get("hosts", [])) + [None], dtype=object)[:-1]

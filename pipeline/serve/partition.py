"""What ``serve`` keeps per partition number: its engine, and what it still needs.

The resume offset of a partition is the earliest message holding a record of
a step its engine has not built yet (those steps are not in a checkpoint, so
their records must be read again after a restart), or the next offset when
every step read so far is built.
"""

from __future__ import annotations

import logging
from operator import itemgetter

from rankscope.pipeline.traces.validate import parse_json

__all__ = ["PartitionState"]

log = logging.getLogger("rankscope.serve")
_STEPPED = frozenset({"step", "check"})  # the types that name a step (beats are progress only)


class PartitionState:
    """One partition number's engine and the offsets it still needs."""

    __slots__ = (
        "_engine", "_factory", "saved_state", "next_offset", "open_steps", "arrival", "waiting",
        "dirty",
    )  # fmt: skip

    def __init__(self, engine_factory) -> None:
        self._engine = None
        self._factory = engine_factory
        self.saved_state: str | None = None  # checkpointed engine state, loaded on first use
        self.next_offset: dict[str, int] = {}  # topic -> offset after the last message read
        self.open_steps: dict[tuple[str, int], int] = {}  # (job, step) -> first offset seen
        self.arrival: dict[tuple[str, int], float] = {}  # (job, step) -> last record's arrival
        self.waiting: dict[tuple[str, int], float] = {}  # same, steps not built yet
        self.dirty = False

    @property
    def engine(self):
        """The partition's engine, made (and restored from its checkpoint) on first use."""
        if self._engine is None:
            self._engine = self._factory()
        if self.saved_state is not None:
            state, self.saved_state = self.saved_state, None
            try:
                self._engine.load_state_dict(parse_json(state))
            except Exception:  # a checkpoint that cannot be loaded must not stop serve for good
                log.exception("checkpointed engine state unusable: starting this partition fresh")
                self._engine = self._factory()
        return self._engine

    def note_steps(self, recs: list[dict], start: int, offset: int, now: float) -> None:
        """Remember where (offset) and when records of each step arrived."""
        part = recs[start:] if start else recs
        if set(map(itemgetter("type"), part)) <= _STEPPED:
            # the usual message: no beats, so every record names its step (C-level passes)
            for key in dict.fromkeys(map(itemgetter("job", "step"), part)):
                self.arrival[key] = now
                self.waiting[key] = now
                if key not in self.open_steps:
                    self.open_steps[key] = offset
            return
        last = None
        for i in range(start, len(recs)):
            rec = recs[i]
            if rec["type"] not in _STEPPED:  # beats, and gpu samples sent to this topic
                continue
            key = (rec["job"], rec["step"])
            if key == last:
                continue
            last = key
            self.arrival[key] = now
            self.waiting[key] = now
            if key not in self.open_steps:
                self.open_steps[key] = offset

    def note_batch(self, job: str, steps, offset: int, now: float) -> None:
        """``note_steps`` for a message decoded as columns (``steps``: its step numbers)."""
        for step in dict.fromkeys(steps.tolist()):
            key = (job, step)
            self.arrival[key] = now
            self.waiting[key] = now
            if key not in self.open_steps:
                self.open_steps[key] = offset

    def built_steps(self, now: float, out: list[float]) -> None:
        """Latency from the last record of each step built since the last call."""
        if not self.waiting:
            return
        asm = self.engine.assembler
        pending = {job: set(asm.pending_steps(job)) for job in {k[0] for k in self.waiting}}
        done = [k for k in self.waiting if k[1] not in pending[k[0]]]
        for k in done:
            out.append(now - self.waiting.pop(k))

    def resume_offset(self, topic: str, telemetry: str) -> int | None:
        nxt = self.next_offset.get(topic)
        if topic != telemetry or nxt is None:
            return nxt
        asm = self.engine.assembler
        pending: dict[str, set[int]] = {}
        keep = {}
        for (job, step), off in self.open_steps.items():
            if job not in pending:
                pending[job] = set(asm.pending_steps(job))
            if step in pending[job]:
                keep[(job, step)] = off
        self.open_steps = keep
        self.arrival = {k: v for k, v in self.arrival.items() if k in keep}
        return min([nxt, *keep.values()])

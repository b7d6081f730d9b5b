"""What one rank is doing right now, and what its current step has cost so far.

Written by the training thread (module and optimizer hooks), by the DDP
communication hook and its completion callbacks (comm threads), read by the
beat thread. Every field is a plain attribute or a list that is only
appended to, so the GIL makes each access atomic and no lock is taken on the
training thread.

Time accounting on the training thread (``time.perf_counter``):

* ``data_s``: from the end of the previous step (or attach) to the first
  forward of this step, less the time inside collectives in between (FSDP2's
  root all-gather before the forward pre-hook, a pipeline stage's receive of
  its input activations): the loop waiting for its input.
* ``comm_s``: time the training thread was inside collectives: inside the
  DDP communication hook's launch, waiting at the end of backward for the
  gradient all-reduce to finish, and inside explicit ``torch.distributed``
  calls.
* ``compute_s = step_s - data_s - comm_s``: everything else (forward,
  backward, optimizer). A rank with a slow backward therefore shows a long
  ``compute_s`` while its peers show a long ``comm_s`` (they wait for it),
  which is what lets a detector blame the right rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rankscope.collectors.rank.run_queue import RunQueueWait

__all__ = ["LastCollective", "StepState"]


@dataclass(slots=True)
class LastCollective:
    """The collective this rank entered last, for beats (hang localization)."""

    group: str
    seq: int
    op: str
    done: bool = False


@dataclass(slots=True)
class StepState:
    """Accumulators of the step in progress plus the live phase."""

    step: int = 0
    phase: str = "idle"
    step_start_perf: float = field(default_factory=time.perf_counter)
    first_forward_perf: float | None = None
    comm_s: float = 0.0
    comm_before_forward_s: float = 0.0  # of comm_s, what came before the first forward
    # DDP buckets of this backward
    buckets: int = 0
    buckets_prev_step: int = 0
    last_launch_exit_perf: float | None = None
    last_done_perf: float | None = None
    buckets_done: int = 0
    tapped_reductions: int = 0  # gradient reductions whose input a tap read this step
    loss_scale: Any = None  # AMP GradScaler's scale this step (amp.py), None without AMP
    local_scaled: bool = True  # local_sq taken during backward (under the loss scale)
    reduced_scaled: bool = True  # reduced_sq taken in the DDP completion callback
    local_sq: list[Any] = field(default_factory=list)  # per-bucket squared norms (tensors/floats)
    reduced_sq: list[Any] = field(default_factory=list)
    nonfinite: list[Any] = field(default_factory=list)
    collectives: list[dict] = field(default_factory=list)
    loss: Any = None
    roots: list[Any] = field(default_factory=list)  # scalar backward roots (loss_roots.py)
    clip_norm: Any = None  # this step's norm from the loop's clip_grad_norm_ (clip_patch.py)
    clip_taps: int = -1  # tapped_reductions when the loop clipped (after them all: reduced)
    clip_seen: bool = False  # the previous step clipped: skip the reduced-norm pass
    # gradient accumulation WITHOUT no_sync: DDP reduces every micro-step, and a later
    # round's bucket holds the earlier rounds' reduced sums (ddp_hook.py)
    bucket_rounds: dict[int, int] = field(default_factory=dict)  # bucket -> launches
    reduced_by_bucket: dict[int, Any] = field(default_factory=dict)  # bucket -> reduced norm
    accumulating: bool = False  # the previous step reduced some bucket more than once
    tokens: int | None = None  # token ids seen by forward this step (or reported)
    # inside a pipeline schedule's metadata inference (pipeline_infer.py): a real forward
    # and backward on made-up inputs whose gradients are thrown away, not measured
    dry_run: bool = False
    last_coll: LastCollective | None = None
    seq: dict[str, int] = field(default_factory=dict)  # per group, never reset
    run_queue: RunQueueWait = field(default_factory=RunQueueWait)  # the training thread's
    run_wait_start: float | None = None  # its run-queue wait at the step's start

    def next_seq(self, group: str) -> int:
        n = self.seq.get(group, 0) + 1
        self.seq[group] = n
        return n

    def enter_collective(self, op: str, group: str, nbytes: int | None) -> dict:
        """Record entering a collective; returns its (mutable) collective entry."""
        seq = self.next_seq(group)
        entry = {"op": op, "group": group, "seq": seq, "t0": time.time()}
        if nbytes is not None:
            entry["bytes"] = nbytes
        self.collectives.append(entry)
        self.last_coll = LastCollective(group=group, seq=seq, op=op)
        return entry

    def finish_collective(self, entry: dict, seconds: float) -> None:
        entry["s"] = seconds
        last = self.last_coll
        if last is not None and last.seq == entry["seq"] and last.group == entry["group"]:
            last.done = True

    def backward_wait_s(self) -> float:
        """How long backward waited for the gradient reductions after the last launch."""
        if self.last_done_perf is None or self.last_launch_exit_perf is None:
            return 0.0
        return max(0.0, self.last_done_perf - self.last_launch_exit_perf)

    def reset_for_next_step(self, now_perf: float) -> None:
        """Start the next step: per-step accumulators cleared, counters kept."""
        self.step += 1
        self.step_start_perf = now_perf  # run_wait_start: set by pending_record's reading
        self.first_forward_perf = None
        self.comm_s = 0.0
        self.comm_before_forward_s = 0.0
        if self.buckets:
            self.buckets_prev_step = self.buckets
        self.buckets = 0
        self.last_launch_exit_perf = None
        self.last_done_perf = None
        self.buckets_done = 0
        self.tapped_reductions = 0
        self.loss_scale = None
        self.local_scaled = True
        self.reduced_scaled = True
        self.local_sq = []
        self.reduced_sq = []
        self.nonfinite = []
        self.collectives = []
        self.loss = None
        self.roots = []
        self.clip_seen = self.clip_norm is not None
        if self.bucket_rounds:
            self.accumulating = max(self.bucket_rounds.values()) > 1
        self.bucket_rounds = {}
        self.reduced_by_bucket = {}
        self.clip_norm = None
        self.clip_taps = -1
        self.tokens = None

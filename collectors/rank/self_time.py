"""What the collector's own code costs the training thread, measured as it runs.

A before/after comparison of step times is the final word on overhead, but
on a shared machine its noise (hundreds of µs a step) is larger than the
cost being measured. The collector therefore also times itself: each of its
entry points on the training thread reads ``time.perf_counter`` (a vDSO
call, well under a microsecond) on the way in and out and adds the
difference here, split by what the time went to. Passes that are not the
collector's own overhead are kept apart so a budget can leave them out:
the local gradient-norm pass (the measurement itself) and launching the
gradient all-reduce (plain DDP launches the same one from C++).

Not counted: the cost of the interpreter entering a Python hook from C++
and cache lines the collector's work evicts. Those only show in the
before/after comparison (``bench/bench_collector_overhead.py`` prints both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["SelfTime"]


@dataclass(slots=True)
class SelfTime:
    """Cumulative seconds of collector code on the training thread, since attach."""

    steps: int = 0
    """Optimizer steps (boundaries) seen."""
    hooks_s: float = 0.0
    """Module and optimizer hooks, ``loss()``, the step record's hand-off."""
    comm_hook_s: float = 0.0
    """The DDP comm hook's bookkeeping and its scaling of the bucket by 1/world (a
    pass plain DDP fuses into its copy), without the two parts below."""
    grad_norm_s: float = 0.0
    """The local gradient-norm pass over the buckets (the measurement itself)."""
    launch_s: float = 0.0
    """Launching the bucket's all-reduce (what plain DDP does from C++ anyway)."""
    digest_s: float = 0.0
    """The parameter digest on the training thread: computed inline, taken over
    from the worker, or waited for."""
    collectives_s: float = 0.0
    """The wrappers of the loop's own ``torch.distributed`` calls (``dist_wrap.py``):
    recording each call, and a tap's bookkeeping beside its norm pass. A loop that
    makes many calls (FSDP2's per-layer gathers, one all-reduce per gradient) pays
    this per call."""

    @property
    def overhead_s(self) -> float:
        """The collector's own cost: everything but the norm pass and the launch."""
        return self.hooks_s + self.comm_hook_s + self.digest_s + self.collectives_s

    def copy(self) -> SelfTime:
        return dataclasses.replace(self)

    def minus(self, earlier: SelfTime) -> SelfTime:
        """The time spent between snapshot ``earlier`` and this one."""
        return SelfTime(
            **{
                f.name: getattr(self, f.name) - getattr(earlier, f.name)
                for f in dataclasses.fields(self)
            }
        )

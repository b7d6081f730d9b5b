"""Slow ranks: compute stragglers and delayed communication.

A straggler stretches the rank's compute, real work and emulated device time
alike (see ``pipeline/simulate/device.py``): in each faulty step it sleeps
``factor - 1`` times the compute it measured, in the forward hook and in the
gradient hooks, i.e. before DDP sees the gradients, so peers end up waiting in
the all-reduce: the backward-origin straggler that per-rank comm time alone
misses; the optimizer step is stretched as well. ``phase=backward`` (or
``forward``) restricts it to one pass.

A network fault delays this rank's all-reduces: the communication hook sleeps
before launching each bucket's reduction.
"""

from __future__ import annotations

import time

from rankscope.pipeline.simulate.faults.base import Fault, FaultContext, register_fault

__all__ = ["Straggler", "NetworkDelay"]


def _factor(value: str) -> float:
    f = float(value)
    if not f >= 1.0 or f > 100:
        raise ValueError("factor should be within 1..100 (1.6 = 60% slower)")
    return f


def _phase(value: str) -> str:
    if value not in ("all", "forward", "backward"):
        raise ValueError("phase should be all, forward or backward")
    return value


def _delay(value: str) -> float:
    d = float(value)
    if not 0.0 < d <= 10.0:
        raise ValueError("delay_s should be within (0, 10] seconds")
    return d


@register_fault
class Straggler(Fault):
    """``straggler:rank=R,from=S[,until=U],factor=F[,phase=all|forward|backward]``."""

    kind = "straggler"
    label_kind = "straggler"
    params = {"factor": _factor, "phase": _phase}

    def __init__(self, spec):
        super().__init__(spec)
        self.factor = spec.params.get("factor", 1.5)
        self.phase = spec.params.get("phase", "all")

    def magnitude(self) -> float:
        return self.factor

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        rank = ctx.rank

        def scaler(phase: str, step: int) -> float:
            if self.phase not in ("all", phase) or not self.spec.active(rank, step):
                return 1.0
            return self.factor

        ctx.extra["device"].add_scaler(scaler)


def _at(value: str) -> str:
    if value not in ("completion", "launch"):
        raise ValueError("at should be completion or launch")
    return value


@register_fault
class NetworkDelay(Fault):
    """``network:rank=R,from=S[,until=U],delay_s=D[,at=completion|launch]``.

    ``at=completion`` (default): each of this rank's bucket all-reduces
    completes D seconds late on this rank (a slow NIC or link: the sleep runs
    on the communication thread, so the rank's next collectives start late
    too and its peers wait for it there). ``at=launch``: the communication
    hook sleeps D seconds on the training thread before launching the
    reduction; every peer then waits exactly as long as the late rank does,
    so per-rank timings barely tell them apart (kept for that contrast).
    """

    kind = "network"
    label_kind = "network"
    params = {"delay_s": _delay, "at": _at}
    required = ("delay_s",)

    def magnitude(self) -> float:
        return self.spec.params["delay_s"]

    def before_all_reduce(self, ctx: FaultContext, bucket) -> None:
        if self.spec.params.get("at") == "launch" and self.spec.active(ctx.rank, ctx.step):
            time.sleep(self.spec.params["delay_s"])

    def after_all_reduce(self, ctx: FaultContext, bucket, tensor):
        if self.spec.params.get("at", "completion") == "completion" and self.spec.active(
            ctx.rank, ctx.step
        ):
            time.sleep(self.spec.params["delay_s"])
        return tensor

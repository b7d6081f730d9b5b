"""Ranks that stop: a hang (blocked forever in forward) and a crash (process exit).

Both act in a forward pre-hook, i.e. in the middle of a real step. A hung
rank's beat thread keeps running and reports ``phase = forward`` while its
peers sit in the next all-reduce; the harness notices that nobody progresses
and ends the run a few seconds later. A crashed rank leaves with
``os._exit`` (no flush, no atexit: the way a segfault or OOM kill leaves); its
peers then fail inside gloo, and the harness collects whoever is left.
"""

from __future__ import annotations

import os
import threading

from rankscope.pipeline.simulate.faults.base import Fault, FaultContext, register_fault

__all__ = ["Hang", "Crash"]


def _exit_code(value: str) -> int:
    code = int(value)
    if not 1 <= code <= 125:
        raise ValueError("code should be within 1..125")
    return code


@register_fault
class Hang(Fault):
    """``hang:rank=R,from=S``: rank R blocks forever in the forward pass of step S."""

    kind = "hang"
    label_kind = "hang"
    ends_run = "hang"

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        forever = threading.Event()

        def pre_forward(module, args):
            if self.spec.active(ctx.rank, ctx.step):
                ctx.report({"fault": self.spec.text, "kind": self.kind, "rank": ctx.rank,
                            "step": ctx.step, "where": "forward"})
                forever.wait()  # never set: the harness ends this process

        ctx.model.register_forward_pre_hook(pre_forward)


@register_fault
class Crash(Fault):
    """``crash:rank=R,from=S[,code=N]``: rank R's process exits in the forward pass of step S."""

    kind = "crash"
    label_kind = "crash"
    ends_run = "crash"
    params = {"code": _exit_code}

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        code = self.spec.params.get("code", 13)

        def pre_forward(module, args):
            if self.spec.active(ctx.rank, ctx.step):
                ctx.report({"fault": self.spec.text, "kind": self.kind, "rank": ctx.rank,
                            "step": ctx.step, "where": "forward", "exit_code": code})
                os._exit(code)

        ctx.model.register_forward_pre_hook(pre_forward)

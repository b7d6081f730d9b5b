"""Faults the tests inject from outside a loop: hooks registered before attach.

* ``straggler``: a forward hook on the model (on each of a pipeline rank's
  stages) sleeps ``(factor - 1) * work_s`` on one rank: that rank's forward is
  ``factor`` times the model's known device time (``model.Work``). A post-hook,
  not a pre-hook: a pre-hook registered before attach would run before the
  collector sees the forward begin, and count as waiting for data.
* ``flip``: an optimizer post-hook flips one mantissa bit of one element of
  this rank's LOCAL parameter tensor after the step (a replica's weights
  diverge silently). Registered before attach, so that step's digest sees it.
* ``nan``: a forward hook on the head makes one logit NaN on one rank: its
  loss and local gradient go non-finite, then every rank's after the reduction.
* ``inf_grad``: a gradient hook on the head's weight puts one inf in this rank's
  local gradient (an fp16 overflow): AMP's scaler skips that step everywhere.

The step a hook acts at is the collector's step in progress (``bind``), so it
matches the recorded step numbers (AMP-skipped iterations included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rankscope.collectors.rank.dtensor import local
from rankscope.pipeline.simulate.faults.base import flip_bit

MANTISSA_BIT = 20


@dataclass(slots=True, frozen=True)
class Fault:
    kind: str  # straggler | flip | nan | inf_grad
    rank: int
    step: int
    until: int | None = None  # last step (None: only ``step`` for flip/nan, the end otherwise)
    factor: float = 1.5

    def active(self, step: int) -> bool:
        if self.kind in ("flip", "nan", "inf_grad") and self.until is None:
            return step == self.step
        return self.step <= step and (self.until is None or step <= self.until)


class _Counter:
    """The step in progress: the collector's, once attached (``bind``)."""

    def __init__(self) -> None:
        self.rc = None
        self.injected: list[dict] = []

    @property
    def step(self) -> int:
        return self.rc.step_index if self.rc is not None else 0

    def bind(self, rc) -> None:
        self.rc = rc


def install(model, optimizer, faults: list[Fault], rank: int, work_s: float) -> _Counter:
    """Register the hooks of this rank's faults (before attach; ``bind`` the collector
    after); ``.injected`` lists what was injected."""
    count = _Counter()
    injected = count.injected
    mine = [f for f in faults if f.rank == rank]
    parts = list(model) if isinstance(model, (list, tuple)) else [model]  # pipeline stages
    for f in mine:
        if f.kind == "straggler":
            extra = (f.factor - 1.0) * work_s

            def slow(module, args, out, f=f, extra=extra):
                if f.active(count.step):
                    time.sleep(extra)

            for part in parts:  # each stage a rank holds takes work_s per forward
                part.register_forward_hook(slow)
        elif f.kind == "flip":
            params = [p for part in parts for p in part.parameters()]
            target = max(params, key=lambda p: local(p).numel())

            def flip(opt, args, kwargs, f=f, target=target):
                if f.active(count.step):
                    with torch.no_grad():
                        before, after = flip_bit(local(target).data, 3, MANTISSA_BIT)
                    injected.append({"kind": "flip", "step": count.step, "before": before,
                                     "after": after})

            optimizer.register_step_post_hook(flip)
        elif f.kind == "nan":
            head = getattr(model, "module", model).head

            def poison(module, args, out, f=f):
                if f.active(count.step):
                    out = out.clone()
                    out.view(-1)[0] = float("nan")
                    return out
                return None

            head.register_forward_hook(poison)
        elif f.kind == "inf_grad":
            weight = getattr(model, "module", model).head.weight

            def overflow(grad, f=f):
                if f.active(count.step):
                    grad = grad.clone()
                    grad.view(-1)[0] = float("inf")
                    return grad
                return None

            weight.register_hook(overflow)
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")
    return count

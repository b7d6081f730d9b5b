"""Silent data corruption and non-finite gradients, injected where real ones arise.

- ``sdc-grad``: one bit of one element of this rank's LOCAL gradient flips
  before the reduction (a parameter-tensor hook, which runs before DDP copies
  the gradient into its bucket). The all-reduce then spreads the damage to
  every replica alike: only the pre-reduction norm points at the origin.
- ``sdc-param``: one bit of one parameter element flips on one replica right
  after the optimizer step (silent replica divergence). The hook is an
  optimizer post-hook registered before the collector attaches, so the
  collector's digest of that very step already differs.
- ``sdc-reduce``: one rank's REDUCED gradient is corrupted after the
  all-reduce (a bad NIC/switch or reduction kernel): that replica diverges.
- ``nonfinite``: one element of this rank's local gradient becomes NaN/Inf.

Which element: ``param=NAME`` (a parameter name, default the largest tensor)
and ``index=N`` (default: drawn from the run seed, the same on every rank).
Every injection is reported to the parent with the value before and after.
"""

from __future__ import annotations

import math
import random

import torch
from rankscope.pipeline.simulate.faults.base import (
    Fault,
    FaultContext,
    flip_bit,
    parse_bit,
    register_fault,
)

__all__ = ["SdcGrad", "SdcParam", "SdcReduce", "NonFinite"]


def _index(value: str) -> int:
    i = int(value)
    if i < 0:
        raise ValueError("index should be >= 0")
    return i


def _nonfinite_value(value: str) -> float:
    if value not in ("nan", "inf", "-inf"):
        raise ValueError("value should be nan, inf or -inf")
    return float(value)


def _relative_change(before: float, after: float) -> float | None:
    if not (math.isfinite(before) and math.isfinite(after)):
        return None
    return abs(after - before) / max(abs(before), 1e-30)


class _ElementFault(Fault):
    """Shared target selection: one element of one parameter (or of a reduced bucket)."""

    label_kind = "sdc"
    params = {"bit": parse_bit, "param": str, "index": _index}
    default_bit = "exponent"
    default_span = 0  # one step unless ``until`` says otherwise

    def __init__(self, spec):
        super().__init__(spec)
        self.bit = spec.params.get("bit", parse_bit(self.default_bit))
        self.param_name: str | None = None
        self.index = 0

    def _choose(self, ctx: FaultContext) -> torch.Tensor:
        named = dict(ctx.model.named_parameters())
        wanted = self.spec.params.get("param")
        if wanted is not None:
            if wanted not in named:
                raise ValueError(
                    f"fault {self.spec.text!r}: no parameter {wanted!r} "
                    f"(parameters: {', '.join(named)})"
                )
            self.param_name = wanted
        else:
            self.param_name = max(named, key=lambda n: named[n].numel())
        p = named[self.param_name]
        default = random.Random(ctx.seed * 7919 + 17).randrange(p.numel())
        self.index = self.spec.params.get("index", default) % p.numel()
        return p

    def _report(self, ctx: FaultContext, where: str, before: float, after: float) -> None:
        ctx.report(
            {
                "fault": self.spec.text,
                "kind": self.kind,
                "rank": ctx.rank,
                "step": ctx.step,
                "where": where,
                "index": self.index,
                "bit": self.bit,
                "before": before if math.isfinite(before) else str(before),
                "after": after if math.isfinite(after) else str(after),
                "magnitude": _relative_change(before, after),
            }
        )


@register_fault
class SdcGrad(_ElementFault):
    """``sdc-grad:rank=R,from=S[,until=U][,bit=exponent|mantissa|N][,param=..][,index=..]``."""

    kind = "sdc-grad"

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        p = self._choose(ctx)

        def hook(grad: torch.Tensor):
            if not self.spec.active(ctx.rank, ctx.step):
                return None
            out = grad.clone()
            before, after = flip_bit(out, self.index, self.bit)
            self._report(ctx, f"grad:{self.param_name}", before, after)
            return out

        p.register_hook(hook)


@register_fault
class SdcParam(_ElementFault):
    """``sdc-param:rank=R,from=S[,bit=..]``: a replica's weights silently diverge."""

    kind = "sdc-param"
    default_bit = "mantissa"  # an exponent flip in a weight is loud (NaN loss), not silent
    persistent = True

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        p = self._choose(ctx)

        def post_step(optimizer, args, kwargs) -> None:
            if self.spec.active(ctx.rank, ctx.step):
                with torch.no_grad():
                    before, after = flip_bit(p.data, self.index, self.bit)
                self._report(ctx, f"param:{self.param_name}", before, after)

        ctx.optimizer.register_step_post_hook(post_step)


@register_fault
class SdcReduce(_ElementFault):
    """``sdc-reduce:rank=R,from=S[,bit=..][,index=..]``: one rank's reduced gradient is wrong."""

    kind = "sdc-reduce"
    params = {"bit": parse_bit, "index": _index}
    persistent = True

    def __init__(self, spec):
        super().__init__(spec)
        self._done_step = -1

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank == self.spec.rank:
            self.param_name = "bucket"
            default = random.Random(ctx.seed * 31 + 5).randrange(1 << 20)
            self.index = self.spec.params.get("index", default)

    def after_all_reduce(self, ctx: FaultContext, bucket, tensor: torch.Tensor):
        if not self.spec.active(ctx.rank, ctx.step) or self._done_step == ctx.step:
            return tensor
        self._done_step = ctx.step  # one element per step, in the first bucket reduced
        index = self.index % tensor.numel()
        before, after = flip_bit(tensor, index, self.bit)
        self._report(ctx, f"reduced-bucket:{bucket.index()}", before, after)
        return tensor


@register_fault
class NonFinite(_ElementFault):
    """``nonfinite:rank=R,from=S[,until=U][,value=nan|inf|-inf]``: a NaN born on one rank."""

    kind = "nonfinite"
    label_kind = "nonfinite"
    params = {"value": _nonfinite_value, "param": str, "index": _index}

    def install(self, ctx: FaultContext) -> None:
        if ctx.rank != self.spec.rank:
            return
        p = self._choose(ctx)
        value = self.spec.params.get("value", math.nan)

        def hook(grad: torch.Tensor):
            if not self.spec.active(ctx.rank, ctx.step):
                return None
            out = grad.clone()
            before = float(out.view(-1)[self.index])
            out.view(-1)[self.index] = value
            self._report(ctx, f"grad:{self.param_name}", before, value)
            return out

        p.register_hook(hook)

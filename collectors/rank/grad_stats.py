"""Gradient norms and non-finite counts, taken so that corruption stays visible.

Shared by the DDP comm hook (one bucket at a time) and by loops without DDP
buckets, whose local gradient is what the parameters' ``.grad`` hold.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["clip_norm_stats", "grad_of", "grads_norm_stats", "tensor_norm_stats"]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient: ``.grad``, else Megatron-LM's ``main_grad`` (a view into
    a flat buffer that a hook adds ``.grad`` into and then frees ``.grad``)."""
    g = p.grad
    if g is None:
        g = getattr(p, "main_grad", None)
        if not isinstance(g, torch.Tensor):
            return None
    return g


def tensor_norm_stats(t: torch.Tensor) -> tuple[Any, Any]:
    """(L2 norm, nonfinite count) of ``t``; on accelerators both stay lazy tensors.

    On CPU the norm is taken in the tensor's own precision (float32 at least),
    which is one vectorized pass; only when that is not finite is it taken
    again accumulating in float64 (an exponent bit flip, ~1e34, squared
    overflows float32 and would turn the very value that shows the corruption
    into inf) and, if still not finite, the nonfinite elements counted. The
    common case is therefore one cheap pass.
    """
    if t.numel() == 0:
        return 0.0, 0
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype in (torch.float32, torch.float64):
            value = float(torch.linalg.vector_norm(t))
        else:
            value = float(torch.linalg.vector_norm(t, dtype=torch.float32))
        if math.isfinite(value):
            return value, 0
        value = float(torch.linalg.vector_norm(t, dtype=torch.float64))
        if math.isfinite(value):
            return value, 0
        return value, int((~torch.isfinite(t)).sum())
    norm = torch.linalg.vector_norm(t, dtype=torch.float64)
    return norm, (~torch.isfinite(t)).sum()


def grads_norm_stats(grads: list[torch.Tensor]) -> tuple[Any, Any]:
    """(L2 norm, nonfinite count) over several gradient tensors (lazy on accelerators).
    float32 CPU gradients take one pass in their own precision first, as
    ``tensor_norm_stats`` does (a fifth of the float64 pass's time on a 28-tensor LM)."""
    if grads and all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads):
        norms = torch._foreach_norm([g.detach() for g in grads])
        value = float(torch.linalg.vector_norm(torch.stack(norms)))
        if math.isfinite(value):
            return value, 0
    # float64 per tensor: a bit-flipped huge element must not overflow to inf
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float64) for g in grads]
    total, _ = tensor_norm_stats(torch.stack(norms))
    if isinstance(total, float) and not math.isfinite(total):
        return total, sum(int((~torch.isfinite(g)).sum()) for g in grads)
    if not isinstance(total, float):
        return total, sum((~torch.isfinite(g)).sum() for g in grads)
    return total, 0


def clip_norm_stats(total: Any, grads: list[torch.Tensor]) -> tuple[Any, Any]:
    """(norm, nonfinite count) from a norm the loop's clipping already computed over
    ``grads``: the elements are only counted when that norm is not finite (on an
    accelerator the count stays a lazy tensor)."""
    if isinstance(total, torch.Tensor) and total.device.type == "cpu":
        total = float(total)
    if isinstance(total, float):
        if math.isfinite(total):
            return total, 0
        return total, sum(int((~torch.isfinite(g)).sum()) for g in grads)
    return total, sum((~torch.isfinite(g)).sum() for g in grads)

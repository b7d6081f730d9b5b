"""The step's gradient norms where no DDP bucket showed them (optimizer pre-hook).

* Plain module on one rank: the local gradient is what ``.grad`` holds; the
  loop's own clipping norm is reused.
* Plain module whose loop all-reduces each ``.grad`` itself: ``grad_norm`` came
  from the all-reduce inputs (``manual_reduce.py``); ``.grad`` now holds the
  reduced gradient. A loop reducing a flat copy: ``.grad`` is taken as local.
  A parameter without ``.grad`` is read through Megatron-LM's ``main_grad``.
* FSDP2 / HSDP: ``grad_norm`` came from the reduce-scatter inputs
  (``fsdp.py``); here ``.grad`` holds this rank's shard of the REDUCED
  gradient, whose norm is ``grad_norm_reduced`` (equal on HSDP replicas of one
  shard). The loop's clipping norm is the global norm of all shards, not this.
* DDP with a communication hook registered before attach: ``.grad`` is the
  reduced gradient; only ``grad_norm_reduced`` is known.
* DTensor tensor parallel without FSDP: norms over the LOCAL parts only (a
  norm of the DTensor itself would be a global, cross-rank reduction).
"""

from __future__ import annotations

from typing import Any

import torch
from rankscope.collectors.rank.dtensor import local
from rankscope.collectors.rank.grad_stats import clip_norm_stats, grad_of, grads_norm_stats
from rankscope.collectors.rank.step_state import StepState

__all__ = ["fallback_grad_stats"]


def fallback_grad_stats(
    st: StepState, params: list[torch.Tensor], *, fsdp: bool, dtensor: bool,
    reduced: bool = False,
) -> bool:  # fmt: skip
    """Fill ``st``'s norms from ``.grad`` where nothing else did; True if it read grads.
    ``reduced``: DDP reduced ``.grad`` through a hook of its own (no local norm)."""
    if st.buckets:
        return False
    tapped = st.tapped_reductions > 0  # the local norm was read before the reductions
    if fsdp or reduced or tapped:
        if (reduced or tapped) and not st.reduced_sq:
            if (tapped and not (fsdp or dtensor) and st.clip_norm is not None
                    and st.clip_taps == st.tapped_reductions):  # fmt: skip
                # a loop reducing its own gradients clipped after its last reduction:
                # that norm is the reduced one (before clipping, as with DDP's buckets)
                st.reduced_sq.append(st.clip_norm)
                st.reduced_scaled = False
                return True
            grads = _local_grads(params)
            if grads:
                st.reduced_sq.append(grads_norm_stats(grads)[0])
                st.reduced_scaled = False  # read at the optimizer step: unscaled by now
                return True
        return False
    if st.local_sq:
        return False
    grads = _local_grads(params) if dtensor else [g for g in map(grad_of, params) if g is not None]
    if not grads:
        return False
    if st.clip_norm is not None and not dtensor:  # the loop clipped: its norm is this one
        total, nonfinite = clip_norm_stats(st.clip_norm, grads)
    else:
        total, nonfinite = grads_norm_stats(grads)
    st.local_sq.append(total)
    st.nonfinite.append(nonfinite)
    st.local_scaled = False  # read at the optimizer step: AMP has unscaled by now
    return True


def _local_grads(params: list[torch.Tensor]) -> list[Any]:
    return [local(g) for g in map(grad_of, params) if g is not None]

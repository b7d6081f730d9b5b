"""The loss a loop backpropagates, read where it does: ``torch.autograd.backward``.

A loop attached in two lines never calls ``rc.loss``: torchtitan's trainer,
for one, keeps its loss inside ``train_step``. Without a loss the NaN-origin
rule cannot tell the rank whose forward went non-finite from a partner that
the backward's collectives poisoned (expert parallelism's all-to-all), and
the record lacks a core field. Every loop hands its loss to autograd, though:
``loss.backward()``, ``scaler.scale(loss).backward()``, Accelerate's
``backward``, a pipeline schedule's last stage all call
``torch.autograd.backward`` with one scalar and no gradient.

At attach the collector wraps that function (restored at close). On the
training thread, outside a pipeline's dry run, a call whose root is one
floating scalar with no gradient given keeps ``root.detach()`` in
``StepState.roots``; nothing is read from the device there. The step's loss
is their sum (gradient accumulation's ``loss / accum`` rounds sum to the
step's mean loss), divided by AMP's loss scale; ``rc.loss()`` overrides it.
A DTensor root counts when replicated, or partial: its local value is then
this rank's part before the reduction (torchtitan's full-DTensor loss, this
rank's summed loss over the job's tokens).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rankscope.collectors.rank.amp import Unscaled
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.step_state import StepState

__all__ = ["BackwardRootPatch", "root_loss"]


def _scalar_root(tensors: Any, grad_tensors: Any) -> torch.Tensor | None:
    """The one scalar root of a ``backward`` call with no gradient given, else None."""
    if isinstance(tensors, Sequence) and not isinstance(tensors, torch.Tensor):
        if len(tensors) != 1:
            return None
        tensors = tensors[0]
        if isinstance(grad_tensors, Sequence) and not isinstance(grad_tensors, torch.Tensor):
            grad_tensors = grad_tensors[0] if len(grad_tensors) == 1 else grad_tensors
    if grad_tensors is not None or not isinstance(tensors, torch.Tensor):
        return None
    if tensors.numel() != 1 or not tensors.is_floating_point():
        return None
    placements = getattr(tensors, "placements", None)
    if placements is not None:  # a DTensor: replicated, or partial (this rank's part)
        if any(p.is_shard() for p in placements):
            return None
        tensors = tensors.to_local()
        if tensors.numel() != 1:
            return None
    return tensors.detach()


def root_loss(roots: list, scale: Any) -> Any:
    """The step's loss from its backward roots (a lazy tensor; None without roots)."""
    if not roots:
        return None
    total = roots[0] if len(roots) == 1 else torch.stack([r.float() for r in roots]).sum()
    return Unscaled(total, scale) if scale is not None else total


class BackwardRootPatch:
    """Wraps ``torch.autograd.backward`` for one collector."""

    def __init__(self, state: StepState, training_thread: int, faults: Faults) -> None:
        self._state, self._thread, self._faults = state, training_thread, faults
        self._orig: Callable | None = None
        self._wrapper: Callable | None = None

    def install(self) -> None:
        self._orig = torch.autograd.backward
        self._wrapper = self._wrap(self._orig)
        torch.autograd.backward = self._wrapper

    def uninstall(self) -> None:
        if self._wrapper is not None and torch.autograd.backward is self._wrapper:
            torch.autograd.backward = self._orig
        self._thread = None  # a wrapper someone wrapped again passes through

    def _wrap(self, orig: Callable) -> Callable:
        state = self._state

        @functools.wraps(orig)
        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            if (
                threading.get_ident() == self._thread
                and not state.dry_run
                and kwargs.get("grad_variables") is None
            ):
                try:
                    root = _scalar_root(tensors, grad_tensors)
                    if root is not None:
                        state.roots.append(root)
                except Exception as exc:
                    self._faults.hit("loss from backward", exc)
            return orig(tensors, grad_tensors, *args, **kwargs)

        backward.__rankscope_wrapped__ = True
        return backward

"""Reusing the loop's own gradient clipping as ``grad_norm_reduced``.

Most training loops clip gradients after backward with
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, which
computes the L2 norm of the gradients as DDP left them: reduced, the very
value ``grad_norm_reduced`` reports. When the loop clips, the collector takes
that norm instead of reading the reduced buckets a second time.

At attach the collector wraps ``clip_grad_norm_`` where loops find it
(``torch.nn.utils`` and ``torch.nn.utils.clip_grad``) and restores it at
close if nobody wrapped it again. A call counts only from the training
thread, with ``norm_type`` 2, over the model's own parameters (as many, the
first and the last the same objects; clipping a subset or another model
gives another norm); anything else passes through untouched. The wrapper
never changes what the call does or returns. A loop that imported the
function by name before attach keeps calling the original, and the
collector keeps computing the norm itself.

The DDP hook's completion callback skips its reduced-norm pass on a step
that follows a step where the loop clipped; if the loop stops clipping, that
one step goes out without ``grad_norm_reduced`` and the next computes it again.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from rankscope.collectors.rank.step_state import StepState

__all__ = ["ClipPatch"]

log = logging.getLogger("rankscope.collectors")

_NAME = "clip_grad_norm_"


class ClipPatch:
    """Installs and removes the ``clip_grad_norm_`` wrapper for one collector."""

    def __init__(self, state: StepState, params: list[torch.Tensor], training_thread: int) -> None:
        self._state = state
        self._n_params = len(params)
        self._ends = (params[0], params[-1]) if params else None
        self._training_thread = training_thread
        self._orig: Callable | None = None
        self._wrapper: Callable | None = None
        self._modules: list[Any] = []

    def install(self) -> None:
        import torch.nn.utils as utils
        import torch.nn.utils.clip_grad as clip_grad

        orig = getattr(clip_grad, _NAME, None)
        if not callable(orig):
            return
        self._orig, self._wrapper = orig, self._wrap(orig)
        for module in (utils, clip_grad):
            if getattr(module, _NAME, None) is orig:
                setattr(module, _NAME, self._wrapper)
                self._modules.append(module)

    def uninstall(self) -> None:
        for module in self._modules:
            if getattr(module, _NAME, None) is self._wrapper:
                setattr(module, _NAME, self._orig)
        self._modules.clear()
        self._training_thread = None  # a wrapper still wrapped by someone passes through

    def _wrap(self, orig: Callable) -> Callable:
        state = self._state

        @functools.wraps(orig)
        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
            if threading.get_ident() != self._training_thread:
                return orig(parameters, max_norm, norm_type, *args, **kwargs)
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            else:
                parameters = list(parameters)  # a generator can be read once: keep it
            total = orig(parameters, max_norm, norm_type, *args, **kwargs)
            try:
                if float(norm_type) == 2.0 and self._is_model(parameters):
                    state.clip_norm = total.detach() if isinstance(total, torch.Tensor) else total
                    state.clip_taps = state.tapped_reductions
            except Exception as exc:
                log.debug("clip_grad_norm_ bookkeeping failed: %s", exc)
            return total

        clip_grad_norm_.__rankscope_wrapped__ = True
        return clip_grad_norm_

    def _is_model(self, parameters: list) -> bool:
        """The model's parameters (a cheap test: count and both ends)."""
        return (
            self._ends is not None
            and len(parameters) == self._n_params
            and parameters[0] is self._ends[0]
            and parameters[-1] is self._ends[1]
        )

"""A pipeline schedule's metadata inference is not a training step's backward.

``torch.distributed.pipelining`` (2.1x, dynamic mode: no shapes given by the
user) learns the shapes of the gradients its stages pass by running a real
forward and backward once, on the first step, with made-up inputs and
targets. FSDP's post-backward hooks reduce-scatter those gradients, DDP's
reducer all-reduces them, and then the stage throws them away (it reshards
and sets every ``.grad`` to None). Read by the taps, they would join the
step's local gradient: torchtitan's pipeline (its loss over made-up labels
is NaN) put 524,288 NaN elements and a NaN ``grad_norm`` into step 0 of every
rank of its last stage.

At attach the collector wraps ``_prepare_backward_infra`` on the stage classes
that define it; while it runs, ``StepState.dry_run`` is set: ``dist_wrap``
calls no tap and the DDP hook reads nothing (the collectives are still
recorded: they are real, on every rank alike). Restored at close where nobody wrapped it
again; a torch without that method is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rankscope.collectors.rank.step_state import StepState

__all__ = ["PipelineInferencePatch"]

_NAME = "_prepare_backward_infra"


def _stage_classes() -> tuple[type, ...]:
    try:
        from torch.distributed.pipelining import stage
    except Exception:  # a torch without pipelining
        return ()
    names = ("_PipelineStageBase", "_PipelineStage", "PipelineStage")
    return tuple(c for c in (getattr(stage, n, None) for n in names) if isinstance(c, type))


class PipelineInferencePatch:
    """Marks the metadata inference's forward and backward as a dry run."""

    def __init__(self, state: StepState, classes: tuple[type, ...] | None = None) -> None:
        self._state = state
        self._classes = classes  # None: torch's stage classes (a test passes its own)
        self._wrapped: list[tuple[type, Callable, Callable]] = []

    def install(self) -> None:
        for cls in self._classes if self._classes is not None else _stage_classes():
            orig = vars(cls).get(_NAME)
            if callable(orig):
                wrapper = self._wrap(orig)
                setattr(cls, _NAME, wrapper)
                self._wrapped.append((cls, orig, wrapper))

    def uninstall(self) -> None:
        for cls, orig, wrapper in self._wrapped:
            if vars(cls).get(_NAME) is wrapper:
                setattr(cls, _NAME, orig)
        self._wrapped.clear()

    def _wrap(self, orig: Callable) -> Callable:
        state = self._state

        @functools.wraps(orig)
        def wrapper(stage: Any, *args: Any, **kwargs: Any) -> Any:
            before = state.dry_run
            state.dry_run = True
            try:
                return orig(stage, *args, **kwargs)
            finally:
                state.dry_run = before

        wrapper.__rankscope_wrapped__ = True
        return wrapper

"""AMP's ``GradScaler``: one record per iteration, skipped steps marked, norms unscaled.

``scaler.step(optimizer)`` runs ``optimizer.step()`` only when the unscaled
gradients are finite; otherwise it skips it (and ``update()`` lowers the
scale). Seen only through optimizer hooks, a skipped iteration would merge
into the next record and shift every later step number. At attach the
collector wraps ``GradScaler.step`` (restored at close, like ``clip_patch``):
for the collector's optimizer, on the training thread, it notes the scale in
effect (the one backward multiplied the loss by) and, when the optimizer step
did not run, closes the iteration as a step record with ``skipped: true``.

Norms taken during backward (DDP buckets, FSDP's reduce-scatter input) carry
the scale; they are divided by it on the sender thread (``Unscaled``). Norms
taken at the optimizer step (after ``scaler.unscale_`` or inside
``scaler.step``, and the loop's clipping after ``unscale_``) are already
unscaled.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from rankscope.collectors.rank.faults import Faults

__all__ = ["ScalerPatch", "Unscaled"]


class Unscaled:
    """A norm read lazily (sender thread) divided by the loss scale it was taken under."""

    __slots__ = ("_norm", "_scale")

    def __init__(self, norm: Any, scale: Any) -> None:
        self._norm, self._scale = norm, scale

    def __float__(self) -> float:
        return float(self._norm) / float(self._scale)

    def __int__(self) -> int:
        return int(float(self))

    def parts(self) -> tuple[Any, Any]:
        return self._norm, self._scale


class ScalerPatch:
    """Wraps ``torch.amp.GradScaler.step`` for one collector."""

    def __init__(
        self,
        optimizer: Any,
        training_thread: int,
        on_scale: Callable[[Any], None],
        on_skipped: Callable[[], None],
        steps_seen: Callable[[], int],
        faults: Faults,
    ) -> None:
        self._optimizer = optimizer
        self._thread = training_thread
        self._on_scale, self._on_skipped, self._steps_seen = on_scale, on_skipped, steps_seen
        self._faults = faults
        self._cls: Any = None
        self._orig: Callable | None = None
        self._wrapper: Callable | None = None

    def install(self) -> None:
        try:
            from torch.amp import GradScaler
        except ImportError:
            return
        self._cls, self._orig = GradScaler, GradScaler.step
        self._wrapper = self._wrap(GradScaler.step)
        GradScaler.step = self._wrapper

    def uninstall(self) -> None:
        if self._cls is not None and self._cls.step is self._wrapper:
            self._cls.step = self._orig
        self._thread = None  # a wrapper someone wrapped again passes through

    def _wrap(self, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def step(scaler, optimizer, *args, **kwargs):
            if optimizer is not self._optimizer or threading.get_ident() != self._thread:
                return orig(scaler, optimizer, *args, **kwargs)
            before = None
            try:
                scale = getattr(scaler, "_scale", None)
                if scaler.is_enabled() and scale is not None:
                    self._on_scale(scale.detach().clone())  # update() changes it in place
                before = self._steps_seen()
            except Exception as exc:
                self._faults.hit("GradScaler bookkeeping", exc)
            out = orig(scaler, optimizer, *args, **kwargs)
            try:
                if before is not None and self._steps_seen() == before:
                    self._on_skipped()  # inf/NaN found: the optimizer step did not run
            except Exception as exc:
                self._faults.hit("GradScaler bookkeeping", exc)
            return out

        step.__rankscope_wrapped__ = True
        return step

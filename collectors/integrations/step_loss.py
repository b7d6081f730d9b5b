"""The loss of a step, read from the model's output when the framework owns the loop.

Frameworks (the Hugging Face ``Trainer``, Lightning) compute the loss inside
their loop, where no ``rc.loss()`` call can go; the module the collector hooks
returns it: a dict or ``ModelOutput`` with ``loss``, or the scalar loss itself
(Lightning's ``training_step``). A forward post-hook keeps the mean over the
step's training micro-batches; evaluation forwards are left out.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepLoss"]


def _output_loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class StepLoss:
    """Forward post-hook: the mean loss of the step's training micro-batches so far."""

    def __init__(self, rc) -> None:
        self.rc, self.step, self.total, self.count = rc, -1, None, 0

    def __call__(self, module, args, output) -> None:
        try:
            loss = _output_loss(output)
            if loss is None or not (module.training and torch.is_grad_enabled()):
                return
            if self.rc.step_index != self.step:
                self.step, self.total, self.count = self.rc.step_index, None, 0
            loss = loss.detach().float()
            self.total = loss if self.total is None else self.total + loss
            self.count += 1
            self.rc.loss(self.total / self.count)
        except Exception as exc:  # never into training
            self.rc.note_failure("step loss hook", exc)

"""A collector attached from a framework's callback, and the loss read from the model.

``Attachment`` is what both callbacks hold: the collector, attached once to the
module and optimizer the framework built, and the loss hook, both undone at the
end of training. Frameworks (the Hugging Face ``Trainer``, Lightning) compute
the loss inside their loop, where no ``rc.loss()`` call can go; the module the
collector hooks returns it: a dict or ``ModelOutput`` with ``loss``, or the scalar loss itself
(Lightning's ``training_step``). A forward post-hook keeps the mean over the
step's training micro-batches; evaluation forwards are left out.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["Attachment", "StepLoss"]

log = logging.getLogger("rankscope.collectors")


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


class Attachment:
    """A collector attached once, at the start of training, and closed at its end."""

    def __init__(self, job: str, sink: Any, attach_kw: dict) -> None:
        self.job, self.sink, self.attach_kw = job, sink, attach_kw
        self.rc = None
        self._hook = None

    def start(self, model: torch.nn.Module, optimizer: Any) -> None:
        if self.rc is not None:
            return
        from rankscope.collectors.rank.collector import RankCollector

        try:
            self.rc = RankCollector.attach(model, optimizer, job=self.job, sink=self.sink,
                                           **self.attach_kw)  # fmt: skip
        except Exception as exc:  # inside the framework's loop: never into training
            log.warning("rankscope collector: not attached (%s); training goes on without it",
                        exc)  # fmt: skip
            return
        self._hook = model.register_forward_hook(StepLoss(self.rc))

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.rc is not None:
            self.rc.close()

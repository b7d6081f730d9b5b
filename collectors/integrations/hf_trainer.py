"""The rank collector inside a Hugging Face ``Trainer``: two lines before ``train()``.

``Trainer`` wraps the model (DDP through Accelerate) and builds the optimizer
inside ``train()``, and hands its callbacks the UNWRAPPED model, on which DDP's
reduction is not seen. So the callback holds the trainer and attaches, at
``on_train_begin``, to ``trainer.model_wrapped`` and ``trainer.optimizer`` (an
``AcceleratedOptimizer``, hooked through the optimizer it holds). The loss is
read from the model's output (``loss`` of the dict or ``ModelOutput``) on
training forwards, averaged over the step's micro-batches; evaluation forwards
are left out. ``transformers`` is imported only when the callback is built.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["attach_trainer", "trainer_callback"]


def _output_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class _StepLoss:
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
            self.rc.note_failure("trainer loss hook", exc)


def trainer_callback(trainer: Any, *, job: str, sink: Any, **attach_kw: Any):
    """A ``TrainerCallback`` that attaches a ``RankCollector`` when ``trainer`` starts
    training and closes it when training ends (``rc`` on the callback, once attached).
    ``attach_kw``: the other keywords of ``RankCollector.attach``."""
    from rankscope.collectors.rank.collector import RankCollector
    from transformers import TrainerCallback

    class RankscopeCallback(TrainerCallback):
        def __init__(self) -> None:
            self.rc: RankCollector | None = None
            self._hook = None

        def on_train_begin(self, args, state, control, **kwargs):
            if self.rc is not None:
                return
            model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
            self.rc = RankCollector.attach(model, trainer.optimizer, job=job, sink=sink,
                                           **attach_kw)  # fmt: skip
            self._hook = model.register_forward_hook(_StepLoss(self.rc))

        def on_train_end(self, args, state, control, **kwargs):
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self.rc is not None:
                self.rc.close()

    return RankscopeCallback()


def attach_trainer(trainer: Any, *, job: str, sink: Any, **attach_kw: Any):
    """Add the collector's callback to ``trainer`` (before ``trainer.train()``); returns
    the callback, whose ``rc`` is the collector once training has begun."""
    callback = trainer_callback(trainer, job=job, sink=sink, **attach_kw)
    trainer.add_callback(callback)
    return callback

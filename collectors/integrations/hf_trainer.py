"""The rank collector inside a Hugging Face ``Trainer``: two lines before ``train()``.

``Trainer`` wraps the model (DDP through Accelerate) and builds the optimizer
inside ``train()``, and hands its callbacks the UNWRAPPED model, on which DDP's
reduction is not seen. So the callback holds the trainer and attaches, at
``on_train_begin``, to ``trainer.model_wrapped`` and ``trainer.optimizer`` (an
``AcceleratedOptimizer``, hooked through the optimizer it holds). The loss is
read from the model's output (``step_loss.py``). ``transformers`` is imported
only when the callback is built.
"""

from __future__ import annotations

from typing import Any

from rankscope.collectors.integrations.step_loss import StepLoss

__all__ = ["attach_trainer", "trainer_callback"]


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
            self._hook = model.register_forward_hook(StepLoss(self.rc))

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

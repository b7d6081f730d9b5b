"""The rank collector inside a Hugging Face ``Trainer``: two lines before ``train()``.

``Trainer`` wraps the model (DDP through Accelerate) and builds the optimizer
inside ``train()``, and hands its callbacks the UNWRAPPED model, on which DDP's
reduction is not seen. So the callback holds the trainer and attaches, at
``on_train_begin``, to ``trainer.model_wrapped`` and ``trainer.optimizer`` (an
``AcceleratedOptimizer``, hooked through the optimizer it holds). The loss is
read from the model's output (``attachment.py``). ``transformers`` is imported
only when the callback is built.
"""

from __future__ import annotations

from typing import Any

from rankscope.collectors.integrations.attachment import Attachment

__all__ = ["attach_trainer", "trainer_callback"]


def trainer_callback(trainer: Any, *, job: str, sink: Any, **attach_kw: Any):
    """A ``TrainerCallback`` that attaches a ``RankCollector`` when ``trainer`` starts
    training and closes it when training ends (``rc`` on the callback, once attached).
    ``attach_kw``: the other keywords of ``RankCollector.attach``."""
    from transformers import TrainerCallback

    class RankscopeCallback(TrainerCallback):
        def __init__(self) -> None:
            self.attached = Attachment(job, sink, attach_kw)

        @property
        def rc(self):
            return self.attached.rc

        def on_train_begin(self, args, state, control, **kwargs):
            wrapped = trainer.model_wrapped
            self.attached.start(wrapped if wrapped is not None else trainer.model,
                                trainer.optimizer)  # fmt: skip

        def on_train_end(self, args, state, control, **kwargs):
            self.attached.stop()

    return RankscopeCallback()


def attach_trainer(trainer: Any, *, job: str, sink: Any, **attach_kw: Any):
    """Add the collector's callback to ``trainer`` (before ``trainer.train()``); returns
    the callback, whose ``rc`` is the collector once training has begun."""
    callback = trainer_callback(trainer, job=job, sink=sink, **attach_kw)
    trainer.add_callback(callback)
    return callback

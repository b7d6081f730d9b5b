"""The rank collector inside a Lightning ``Trainer``: one callback.

Lightning wraps the ``LightningModule`` (DDP under the ``ddp`` strategies) and
builds the optimizers from ``configure_optimizers`` inside ``fit()``. The
callback attaches at ``on_train_start``, when both exist: to
``trainer.strategy.model`` (the wrapper whose forward runs ``training_step``,
so its communication hook sees the gradient reduction) and to the first of
``trainer.optimizers`` (its step marks the boundary; with several optimizers,
as in manual optimization, that first one's step is the step). The loss is
what ``training_step`` returns (``attachment.py``). ``lightning`` (or the older
``pytorch_lightning``) is imported only when the callback is built.
"""

from __future__ import annotations

from typing import Any

from rankscope.collectors.integrations.attachment import Attachment

__all__ = ["lightning_callback"]


def _callback_base() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback
    return Callback


def lightning_callback(*, job: str, sink: Any, **attach_kw: Any):
    """A Lightning ``Callback`` that attaches a ``RankCollector`` when training starts
    and closes it when it ends (``rc`` on the callback, once attached); pass it in
    ``Trainer(callbacks=[...])``. ``attach_kw``: the other keywords of
    ``RankCollector.attach``."""

    class RankscopeCallback(_callback_base()):
        def __init__(self) -> None:
            self.attached = Attachment(job, sink, attach_kw)

        @property
        def rc(self):
            return self.attached.rc

        def on_train_start(self, trainer, pl_module) -> None:
            model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
            self.attached.start(model, trainer.optimizers[0] if trainer.optimizers else None)

        def on_train_end(self, trainer, pl_module) -> None:
            self.attached.stop()

    return RankscopeCallback()

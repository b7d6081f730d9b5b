"""Detector state made of named parts that save and restore themselves.

The straggler, network and metric-outlier states hold the same kinds of
parts: a peer cache, per-rank clean histories, streak counters with their
chance rates, the windowed test's rings. Each part has ``state_dict`` and
``load_state_dict``; ``PartsState`` saves every part listed in ``PARTS``
under its name and restores the parts a saved dict holds, so a state saved
before a part existed still loads (the part starts fresh) and adding a part
is one name, not two hand-written lines that can drift apart. Parts listed
in ``REQUIRED`` must be present (a dict without them is not this state).

``make_window`` builds the windowed test's ``SlowWindow`` from a config with
the usual field names, the same way for every detector that has one.
"""

from __future__ import annotations

from rankscope.detectors.stats.slow_window import SlowWindow

__all__ = ["PartsState", "make_window"]


class PartsState:
    """Mixin: ``state_dict`` / ``load_state_dict`` over the attributes named in ``PARTS``."""

    __slots__ = ()
    PARTS: tuple[str, ...] = ()
    REQUIRED: tuple[str, ...] = ("history",)

    def state_dict(self) -> dict:
        return {name: getattr(self, name).state_dict() for name in self.PARTS}

    def load_state_dict(self, d: dict) -> None:
        for name in self.PARTS:
            if name in d:
                getattr(self, name).load_state_dict(d[name])
            elif name in self.REQUIRED:
                raise KeyError(f"saved state has no {name!r}")


def make_window(cfg) -> SlowWindow:
    """The ``SlowWindow`` of a config with window_steps, window_clip and history sizes."""
    return SlowWindow(
        cfg.window_steps,
        clip=cfg.window_clip,
        history=cfg.history_steps,
        min_steps=cfg.history_min_steps,
    )

"""Detector state made of named parts that save and restore themselves.

Design notes: docs/detectors.md, "detectors/stats/history_state.py".
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

"""The list of detectors the engine runs on every assembled step.

Design notes: docs/detectors.md, "detectors/registry.py".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankscope.detectors import metric_outlier, nonfinite_origin
from rankscope.detectors.gpu import health as gpu_health
from rankscope.detectors.gpu import throttle as gpu_throttle
from rankscope.detectors.hang import monitor as hang_monitor
from rankscope.detectors.network import detector as network
from rankscope.detectors.straggler import detector as straggler
from rankscope.detectors.votes import check as check_vote
from rankscope.detectors.votes import digest as digest_vote
from rankscope.detectors.votes import reduced_grad

__all__ = [
    "DetectorSpec", "DETECTORS", "default_configs", "spec_by_name",
    "BeatSpec", "BEAT_DETECTORS", "beat_monitor_factory",
]


@dataclass(frozen=True, slots=True)
class DetectorSpec:
    """One detector: its name, its Config class, a state factory and the detect function."""

    name: str
    config_cls: type
    make_state: Callable[[Any], Any]
    detect: Callable[[Any, Any, Any], Any]


def _spec(module) -> DetectorSpec:
    """Build a spec from a detector module's conventional names."""
    return DetectorSpec(
        name=module.NAME,
        config_cls=module.CONFIG,
        make_state=module.STATE,
        detect=module.detect,
    )


DETECTORS: tuple[DetectorSpec, ...] = tuple(
    _spec(m)
    for m in (
        straggler,
        network,
        metric_outlier,
        digest_vote,
        reduced_grad,
        check_vote,
        nonfinite_origin,
        gpu_health,
        gpu_throttle,
    )
)


def default_configs() -> dict[str, Any]:
    """name -> a fresh default Config for every registered detector."""
    return {spec.name: spec.config_cls() for spec in DETECTORS}


def spec_by_name(name: str) -> DetectorSpec:
    """The spec called ``name``; KeyError listing the known names otherwise."""
    for spec in DETECTORS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown detector {name!r}; known: {', '.join(s.name for s in DETECTORS)}")


@dataclass(frozen=True, slots=True)
class BeatSpec:
    """A detector over progress beats: one stateful monitor per job instead of a pure
    ``detect`` per step (hangs need time between steps, not just steps)."""

    name: str
    config_cls: type
    make_monitor: Callable[[Any, bool], Any]  # (config, live) -> monitor


BEAT_DETECTORS: tuple[BeatSpec, ...] = (
    BeatSpec(name=hang_monitor.NAME, config_cls=hang_monitor.CONFIG,
             make_monitor=hang_monitor.make_monitor),
)  # fmt: skip


def beat_monitor_factory(live: bool, config: Any = None) -> Callable[[str], Any]:
    """job -> a fresh monitor of the registered beat detector (the engine's default).

    The engine drives one beat monitor per job, so exactly one is registered.
    """
    (spec,) = BEAT_DETECTORS
    cfg = config if config is not None else spec.config_cls()
    return lambda job: spec.make_monitor(cfg, live)

"""Collectors that run inside (or beside) a training job and stream telemetry.

``RankCollector`` attaches to a torch training loop; ``GpuCollector`` samples
NVML; ``make_sink`` builds a sink from a URL (``file://DIR``,
``embedded[://NAME]``, ``kafka://...``); ``Sender`` is the never-blocking
bounded queue in front of a sink. Names load on first use, so the service side
importing ``rankscope.collectors.schema`` pays for neither torch nor NVML.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CollectorConfig",
    "GpuCollector",
    "RankCollector",
    "Sender",
    "SenderStats",
    "make_sink",
]

_HOMES = {
    "CollectorConfig": "rankscope.collectors.rank.config",
    "GpuCollector": "rankscope.collectors.gpu.collector",
    "RankCollector": "rankscope.collectors.rank.collector",
    "Sender": "rankscope.collectors.sinks.sender",
    "SenderStats": "rankscope.collectors.sinks.sender",
    "make_sink": "rankscope.collectors.sinks.factory",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rankscope.collectors' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)

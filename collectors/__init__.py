"""Collectors that run inside (or beside) a training job and stream telemetry.

``RankCollector`` attaches to a torch training loop; ``make_sink`` builds a
sink from a URL (``file://DIR``, ``embedded[://NAME]``, ``kafka://...``);
``Sender`` is the never-blocking bounded queue in front of a sink.
``RankCollector`` imports torch, so it is loaded on first use: a host-side
collector that only needs a sink does not pay for torch.
"""

from __future__ import annotations

from typing import Any

from collectors.config import CollectorConfig
from collectors.sender import Sender, SenderStats
from collectors.sinks import make_sink

__all__ = ["CollectorConfig", "RankCollector", "Sender", "SenderStats", "make_sink"]


def __getattr__(name: str) -> Any:
    if name == "RankCollector":
        from collectors.rank_collector import RankCollector

        return RankCollector
    raise AttributeError(f"module 'collectors' has no attribute {name!r}")

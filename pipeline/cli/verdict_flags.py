"""``--crash-within`` and ``--hang-within``: the live verdict deadlines of ``serve`` and ``demo``.

Both set the hang monitor's Config (``detectors/hang/monitor.py``; docs/hangs.md,
"Faster live verdicts"); unset flags keep its defaults (5 s and 10 s).
"""

from __future__ import annotations

import dataclasses

__all__ = ["add_verdict_flags", "verdict_configs"]


def add_verdict_flags(p) -> None:
    p.add_argument("--crash-within", type=float, metavar="S",
                   help="name a rank whose beats stopped while its peers beat on within S "
                        "seconds of its last beat (default 5)")  # fmt: skip
    p.add_argument("--hang-within", type=float, metavar="S",
                   help="name a hang after max(S, 10 x the p99 step time) without progress "
                        "(default 10)")  # fmt: skip


def verdict_configs(args) -> dict:
    """``detector_configs`` for the engine from the flags ({} when none is given);
    raises ValueError naming what is wrong."""
    from rankscope.detectors.hang.monitor import NAME, Config

    crash, hang = getattr(args, "crash_within", None), getattr(args, "hang_within", None)
    if crash is None and hang is None:
        return {}
    cfg = Config()
    if crash is not None:
        if not crash > 0:
            raise ValueError(f"--crash-within must be > 0, got {crash}")
        # the part kept for the beats' travel shrinks with a tight bound
        cfg = dataclasses.replace(cfg, crash_s=crash, crash_margin_s=min(cfg.crash_margin_s,
                                                                         crash / 2))  # fmt: skip
    if hang is not None:
        if not hang > 0:
            raise ValueError(f"--hang-within must be > 0, got {hang}")
        cfg = dataclasses.replace(cfg, stall_min_s=hang)
    return {NAME: cfg}

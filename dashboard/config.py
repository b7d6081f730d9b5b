"""The dashboard's one configuration object.

Every knob the triage app has lives here, with its unit in its name, so the
Streamlit layer, the query functions, the tests and the benchmark agree on
one set of defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DashboardConfig", "DB_ENV", "DEFAULT_DB", "REFRESH_ENV"]

# `rankscope dashboard --db PATH` hands the path to the Streamlit script in
# this variable (Streamlit owns the script's argv).
DB_ENV = "RANKSCOPE_DB"
DEFAULT_DB = "rankscope.duckdb"
# Seconds between automatic re-runs of a page; 0 turns them off.
REFRESH_ENV = "RANKSCOPE_DASHBOARD_REFRESH_S"


@dataclass(kw_only=True, slots=True)
class DashboardConfig:
    """How the dashboard reads and writes the findings store and how much it draws."""

    db_path: str = DEFAULT_DB
    """The DuckDB findings store that `replay` or `serve` writes."""
    open_attempts: int = 4
    """Read-only opens tried while a writer holds the file lock, before using a snapshot."""
    open_backoff_s: float = 0.05
    """First wait between tries; doubles each time up to ``max_backoff_s``."""
    max_backoff_s: float = 0.5
    """Longest single wait between tries."""
    write_attempts: int = 10
    """Tries of the short triage write connection (about 4 s in all) before giving up."""
    snapshot_dir: str | None = None
    """Where snapshot copies of a locked store go; None: a folder under the system temp dir."""
    heatmap_max_ranks: int = 128
    """At most this many rank rows in the heatmap; more ranks are binned on the server."""
    heatmap_max_steps: int = 200
    """At most this many step columns in the heatmap; more steps are binned on the server."""
    recent_window_s: float = 3600.0
    """What "findings in the last hour" means, in seconds."""
    evidence_window_steps: int = 64
    """Steps of history shown before a finding's onset in its evidence plot."""
    max_finding_points: int = 5000
    """At most this many findings drawn on the step-axis chart (the table shows all)."""
    refresh_s: float = 10.0
    """Seconds between automatic re-runs of the page while it is open; 0: off."""
    live_max_mb: float = 256.0
    """No automatic re-runs over a store file larger than this (each costs a full render)."""
    persist_threshold: float = 3.0
    """A rank-step counts toward a rank's persistence when its |score| reaches this."""
    timeline_max_steps: int = 2000
    """At most this many steps of raw trace records read for a rank's timeline."""

    def __post_init__(self) -> None:
        if not self.db_path:
            raise ValueError("db_path must name a DuckDB file")
        for name in ("open_attempts", "write_attempts", "evidence_window_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.open_backoff_s > 0 or not self.max_backoff_s >= self.open_backoff_s:
            raise ValueError(
                "backoff must be positive and max_backoff_s >= open_backoff_s, got "
                f"{self.open_backoff_s} and {self.max_backoff_s}"
            )
        if self.heatmap_max_ranks < 2 or self.heatmap_max_steps < 2:
            raise ValueError(
                "heatmap must allow at least 2 x 2 cells, got "
                f"{self.heatmap_max_ranks} x {self.heatmap_max_steps}"
            )
        if not self.recent_window_s > 0:
            raise ValueError(f"recent_window_s must be positive, got {self.recent_window_s}")
        if self.refresh_s < 0 or (0 < self.refresh_s < 1):
            raise ValueError(f"refresh_s must be 0 (off) or at least 1 s, got {self.refresh_s}")
        if not self.live_max_mb > 0:
            raise ValueError(f"live_max_mb must be positive, got {self.live_max_mb}")
        if not self.persist_threshold > 0:
            raise ValueError(f"persist_threshold must be positive, got {self.persist_threshold}")
        if self.timeline_max_steps < 10:
            raise ValueError(
                f"timeline_max_steps must be at least 10, got {self.timeline_max_steps}"
            )
        if self.max_finding_points < 1:
            raise ValueError(
                f"max_finding_points must be at least 1, got {self.max_finding_points}"
            )

    def live_every_s(self, store_bytes: int | None) -> float | None:
        """Seconds between automatic re-runs for a store this big; None: no auto-refresh."""
        if not self.refresh_s or store_bytes is None or store_bytes > self.live_max_mb * 1e6:
            return None
        return self.refresh_s

    @classmethod
    def from_env(cls, **overrides) -> DashboardConfig:
        """The config of a dashboard started by `rankscope dashboard` (db path from the env)."""
        overrides.setdefault("db_path", os.environ.get(DB_ENV) or DEFAULT_DB)
        raw = os.environ.get(REFRESH_ENV)
        if raw and "refresh_s" not in overrides:
            try:
                overrides["refresh_s"] = float(raw)
            except ValueError:
                msg = f"{REFRESH_ENV} must be a number of seconds, got {raw!r}"
                raise ValueError(msg) from None
        return cls(**overrides)

"""The dashboard's one configuration object.

Every knob the triage app has lives here, with its unit in its name, so the
Streamlit layer, the query functions, the tests and the benchmark agree on
one set of defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DashboardConfig", "DB_ENV", "DEFAULT_DB"]

# `rankscope dashboard --db PATH` hands the path to the Streamlit script in
# this variable (Streamlit owns the script's argv).
DB_ENV = "RANKSCOPE_DB"
DEFAULT_DB = "rankscope.duckdb"


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
        if self.max_finding_points < 1:
            raise ValueError(
                f"max_finding_points must be at least 1, got {self.max_finding_points}"
            )

    @classmethod
    def from_env(cls, **overrides) -> DashboardConfig:
        """The config of a dashboard started by `rankscope dashboard` (db path from the env)."""
        overrides.setdefault("db_path", os.environ.get(DB_ENV) or DEFAULT_DB)
        return cls(**overrides)

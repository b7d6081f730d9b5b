"""The service's own DuckDB tables, beside the findings of ``pipeline.store``.

- ``serve_checkpoints``: per consumer group and partition, the offset to
  resume from and the engine state that goes with it. Written after the
  findings of everything before that offset are stored, then the same offset
  is committed to Kafka. A restarted (or newly assigned) ``serve`` loads the
  state and seeks there, so nothing is lost, and findings rebuilt from
  re-read records land on the same ``finding_id`` rows (no duplicates).

Dead letters go to the store's ``bad_records`` table and actions announced on
the control topic to its ``actions.delivered_t`` (``pipeline.store``).

Every write is parameterized SQL and idempotent (a primary key and
``INSERT OR REPLACE``).
"""

from __future__ import annotations

import time

__all__ = ["ServeTables"]

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS serve_checkpoints (
        grp VARCHAR NOT NULL, topic VARCHAR NOT NULL, part INTEGER NOT NULL,
        next_offset BIGINT NOT NULL, engine_state VARCHAR, updated_t DOUBLE,
        PRIMARY KEY (grp, topic, part))""",
)


class ServeTables:
    """Reads and writes the service tables through one DuckDB connection."""

    def __init__(self, con) -> None:
        self.con = con
        for stmt in _SCHEMA:
            con.execute(stmt)

    def load_checkpoint(self, group: str, topic: str, part: int) -> tuple[int, str | None] | None:
        row = self.con.execute(
            "SELECT next_offset, engine_state FROM serve_checkpoints "
            "WHERE grp = ? AND topic = ? AND part = ?",
            [group, topic, part],
        ).fetchone()
        return None if row is None else (int(row[0]), row[1])

    def save_checkpoints(self, group: str, rows: list[tuple[str, int, int, str | None]]) -> None:
        """``rows``: (topic, partition, next_offset, engine_state_json)."""
        if not rows:
            return
        now = time.time()
        self.con.executemany(
            "INSERT OR REPLACE INTO serve_checkpoints VALUES (?, ?, ?, ?, ?, ?)",
            [(group, topic, part, off, state, now) for topic, part, off, state in rows],
        )

    def stored_actions(self) -> dict[str, str]:
        """finding_id -> action of every stored finding (what a restarted serve knows)."""
        return dict(self.con.execute("SELECT finding_id, action FROM findings").fetchall())

    def announced(self) -> set[tuple[str, str]]:
        """(finding_id, action) pairs already published on the control topic."""
        rows = self.con.execute(
            "SELECT finding_id, action FROM actions WHERE delivered_t IS NOT NULL"
        ).fetchall()
        return {(fid, action) for fid, action in rows}

"""Which findings each webhook has had: ``serve_alerts`` in the service's DuckDB file.

Written on a webhook's thread after each 2xx (one short parameterized insert,
under the ``ServeDb`` session lock the writer thread also takes), read once at
start, so a restarted ``serve`` does not post again what it posted before.
Webhooks are keyed by a hash of their URL (``alerts.webhook_key``): URLs may
hold tokens, and the store is read by the dashboard.
"""

from __future__ import annotations

import logging
import time

from rankscope.pipeline.serve.alerts import webhook_key

__all__ = ["AlertLedger"]

log = logging.getLogger("rankscope.serve.alerts")

_SCHEMA = """CREATE TABLE IF NOT EXISTS serve_alerts (
    finding_id VARCHAR NOT NULL, webhook VARCHAR NOT NULL, sent_t DOUBLE,
    PRIMARY KEY (finding_id, webhook))"""


class AlertLedger:
    """Reads and marks alerts through a ``ServeDb`` (``rankscope.pipeline.serve.db``)."""

    def __init__(self, db) -> None:
        self._db = db
        with db.session() as s:
            s.store.con.execute(_SCHEMA)

    def delivered(self) -> dict[str, set[str]]:
        """Webhook key -> finding ids posted with a 2xx answer."""
        with self._db.session() as s:
            rows = s.store.con.execute("SELECT webhook, finding_id FROM serve_alerts").fetchall()
        out: dict[str, set[str]] = {}
        for hook, fid in rows:
            out.setdefault(hook, set()).add(fid)
        return out

    def mark(self, finding_id: str, url: str) -> None:
        try:
            with self._db.session() as s:
                s.store.con.execute(
                    "INSERT OR REPLACE INTO serve_alerts VALUES (?, ?, ?)",
                    [finding_id, webhook_key(url), time.time()],
                )
        except Exception as exc:  # the alert went out; a restart may post it again (logged)
            log.warning("could not record the alert for finding %s: %s", finding_id, exc)

"""The DuckDB findings store (default ``./rankscope.duckdb``).

Tables (schema version 2):

- ``jobs``: one row per job: world, hosts, last step and time seen, frames
  assembled, where the data came from, and what was lost on the way (version
  2: ``late``, ``forced``, ``partial_frames``, ``refused``, ``dropped``; see
  ``pipeline/engine/step_buffers.py`` ``LOSS_COUNTS``).
- ``findings``: the trace format's findings shape plus ``finding_id``
  (primary key) and ``unattributed``; ``ranks`` INTEGER[], ``hosts``
  VARCHAR[], ``evidence`` JSON.
- ``actions``: each evict / recover decision: (finding_id, action) with the
  step and record time at which it was first decided; ``delivered_t`` is set
  by whoever delivers it (the control channel).
- ``scores``: per-rank detector scores for the heatmap, long format (job,
  step, steps, rank, metric, score); ``step`` is the first step of a bucket
  of ``steps`` steps (see ``pipeline/engine/scores.py`` for why and how big).
- ``triage``: a person's verdict on a finding (confirmed, false_alarm,
  resolved) with a note: the dashboard's only write.
- ``bad_records``: malformed input (file:line or topic:offset and the reason).
- ``host_rollup`` (view): findings per job and host, the worst action.
- ``schema_version``: the applied migrations.

Writes are idempotent: every table has a primary key and writes are
``INSERT OR REPLACE`` (or ``OR IGNORE`` for actions, whose first decision
wins), and no column holds the wall time of the write, so replaying the same
trace twice leaves exactly the same rows. Every value goes in as a query
parameter or through a registered Arrow table; no SQL is built from input.
DuckDB allows one writing process: readers (the dashboard) open with
``read_only=True``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import orjson
import pyarrow as pa
from rankscope.pipeline.engine.findings import Finding

__all__ = [
    "Store", "StoreError", "SCHEMA_VERSION", "DEFAULT_DB", "TRIAGE_STATUSES", "TRIAGE_CHOICES",
    "write_triage",
]

DEFAULT_DB = "rankscope.duckdb"
TRIAGE_STATUSES = ("confirmed", "false_alarm", "resolved")
# "open" is the absence of a verdict (no triage row); the others are stored statuses.
TRIAGE_CHOICES = ("open", *TRIAGE_STATUSES)
TRIAGE_NOTE_MAX = 10_000

# version -> statements; a new version appends, never edits an applied one.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE jobs (
            job VARCHAR PRIMARY KEY, world INTEGER, hosts INTEGER, last_step BIGINT,
            frames BIGINT, last_t DOUBLE, source VARCHAR)""",
        """CREATE TABLE findings (
            finding_id VARCHAR PRIMARY KEY, job VARCHAR NOT NULL, kind VARCHAR NOT NULL,
            ranks INTEGER[], hosts VARCHAR[], first_step BIGINT, last_step BIGINT,
            detected_step BIGINT, detected_t DOUBLE, score DOUBLE, detector VARCHAR,
            action VARCHAR, evidence JSON, unattributed BOOLEAN)""",
        "CREATE INDEX findings_job ON findings (job)",
        """CREATE TABLE actions (
            finding_id VARCHAR, action VARCHAR, job VARCHAR, ranks INTEGER[], hosts VARCHAR[],
            step BIGINT, issued_t DOUBLE, delivered_t DOUBLE, PRIMARY KEY (finding_id, action))""",
        """CREATE TABLE scores (
            job VARCHAR, step BIGINT, steps INTEGER, rank INTEGER, metric VARCHAR, score DOUBLE,
            PRIMARY KEY (job, step, rank, metric))""",
        """CREATE TABLE triage (
            finding_id VARCHAR PRIMARY KEY,
            status VARCHAR CHECK (status IN ('confirmed', 'false_alarm', 'resolved')),
            note VARCHAR, t DOUBLE)""",
        """CREATE TABLE bad_records (
            source VARCHAR, location VARCHAR, reason VARCHAR, PRIMARY KEY (source, location))""",
        """CREATE VIEW host_rollup AS
            SELECT f.job, h.host, count(*) AS findings, list(DISTINCT f.kind) AS kinds,
                   CASE max(CASE f.action WHEN 'evict' THEN 2 WHEN 'recover' THEN 1 ELSE 0 END)
                        WHEN 2 THEN 'evict' WHEN 1 THEN 'recover' ELSE 'observe' END AS action,
                   min(f.first_step) AS first_step, max(f.last_step) AS last_step
            FROM findings f, unnest(f.hosts) AS h(host)
            WHERE NOT f.unattributed
            GROUP BY f.job, h.host""",
    ),
    # what each job lost (Engine.job_summary, step_buffers.LOSS_COUNTS)
    2: tuple(
        f"ALTER TABLE jobs ADD COLUMN {c} BIGINT"
        for c in ("late", "forced", "partial_frames", "refused", "dropped")
    ),
}
SCHEMA_VERSION = max(MIGRATIONS)

_FINDING_COLS = (
    "finding_id", "job", "kind", "ranks", "hosts", "first_step", "last_step", "detected_step",
    "detected_t", "score", "detector", "action", "evidence", "unattributed",
)  # fmt: skip


_UPSERT_FINDING = (
    "INSERT OR REPLACE INTO findings (finding_id, job, kind, ranks, hosts, first_step, last_step,"
    " detected_step, detected_t, score, detector, action, evidence, unattributed)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_LIST_FINDINGS = (
    "SELECT f.finding_id, f.job, f.kind, f.ranks, f.hosts, f.first_step, f.last_step,"
    " f.detected_step, f.detected_t, f.score, f.detector, f.action, f.evidence,"
    " f.unattributed, t.status FROM findings f"
    " LEFT JOIN triage t ON t.finding_id = f.finding_id"
    " WHERE (CAST(? AS VARCHAR) IS NULL OR f.job = ?)"
    " AND (CAST(? AS VARCHAR) IS NULL OR f.kind = ?)"
    " ORDER BY f.job, f.first_step, f.kind, f.ranks, f.detector LIMIT ?"
)


class StoreError(Exception):
    """The database cannot be used (missing, newer schema, not a DuckDB file)."""


class Store:
    """A DuckDB findings store; ``Store(path)`` creates or migrates, ``read_only`` only reads."""

    def __init__(self, path: str | os.PathLike = DEFAULT_DB, read_only: bool = False,
                 con=None) -> None:  # fmt: skip
        """``con``: an open connection to use (``store_read`` hands over a snapshot's)."""
        import duckdb

        self.path = Path(path)
        if con is not None:
            self.con, self.read_only = con, read_only
            self._check_version()
            return
        if read_only and not self.path.is_file():
            raise StoreError(f"{self.path}: no findings store here (run `rankscope replay "
                             f"TRACE --db {self.path}` or `rankscope serve` first)")  # fmt: skip
        if not read_only and self.path.parent and not self.path.parent.is_dir():
            raise StoreError(f"{self.path}: directory {self.path.parent} does not exist")
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except (duckdb.IOException, duckdb.Error) as exc:
            raise StoreError(f"{self.path}: cannot open DuckDB store: {exc}") from exc
        self.read_only = read_only
        self._check_version()
        if not read_only:
            self._prime_arrow_scan()

    def _prime_arrow_scan(self) -> None:
        """Scan a one-row arrow table once, now: DuckDB's first scan of one imports what it
        lazily needs (pandas where installed, ~0.5 s), which must not stall a running
        service's loop at its first score write."""
        self.con.register("rankscope_prime", pa.table({"x": pa.array([0], pa.int8())}))
        try:
            self._x("SELECT count(*) FROM rankscope_prime")
        finally:
            self.con.unregister("rankscope_prime")

    def _check_version(self) -> None:
        read_only = self.read_only
        version = self.version()
        if version > SCHEMA_VERSION:
            self.close()
            raise StoreError(f"{self.path}: schema version {version} is newer than this "
                             f"rankscope knows ({SCHEMA_VERSION}); upgrade rankscope")  # fmt: skip
        if version < SCHEMA_VERSION:
            if read_only:
                self.close()
                raise StoreError(
                    f"{self.path}: schema version {version} is older than {SCHEMA_VERSION};"
                    " open it once for writing to migrate"
                )
            self._migrate(version)

    # -- schema ------------------------------------------------------------
    def version(self) -> int:
        """The applied schema version (0 for an empty database)."""
        has = self.con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
            ["schema_version"],
        ).fetchall()[0][0]
        if not has:
            return 0
        row = self.con.execute("SELECT max(version) FROM schema_version").fetchall()[0]
        return int(row[0] or 0)

    def _migrate(self, current: int) -> None:
        self._x("BEGIN TRANSACTION")
        try:
            self._x("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY)")
            for v in sorted(MIGRATIONS):
                if v <= current:
                    continue
                for stmt in MIGRATIONS[v]:
                    self._x(stmt)
                self._x("INSERT INTO schema_version VALUES (?)", [v])
            self._x("COMMIT")
        except Exception:
            self._x("ROLLBACK")
            raise

    def _x(self, sql: str, params: list | None = None) -> list:
        """Execute and fetch, so no half-read result blocks the connection (DuckDB >= 2)."""
        return self.con.execute(sql, params).fetchall() if params is not None else (
            self.con.execute(sql).fetchall())  # fmt: skip

    def _many(self, sql: str, rows: list) -> None:
        self.con.executemany(sql, rows)
        self.con.fetchall()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writes ------------------------------------------------------------
    def write_turn(self, *, findings: Iterable[Finding] = (), scores: Iterable[dict] = (),
                   jobs: Iterable[dict] = (), source: str | None = None) -> None:
        """What the engine produced since the last turn: the one engine-to-store write.

        ``findings`` from ``Engine.feed`` / ``tick`` / ``flush``, ``scores`` from
        ``Engine.drain_scores``, ``jobs`` from ``Engine.job_summary``; replay, the
        demo and ``serve`` all write through here.
        """
        findings = list(findings)
        if findings:
            self.upsert_findings(findings)
        for cols in scores:
            self.upsert_scores(cols)
        for summary in jobs:
            self.record_job(summary, source=source)

    def upsert_findings(self, findings: Iterable[Finding]) -> int:
        """Insert or replace findings by id; record their evict/recover actions. Returns count."""
        rows, actions = [], []
        for f in findings:
            d = f.to_dict()
            rows.append([
                f.finding_id, d["job"], d["kind"], d["ranks"], d["hosts"], d["first_step"],
                d["last_step"], d["detected_step"], d["detected_t"], d["score"], d["detector"],
                d["action"], orjson.dumps(d["evidence"]).decode(), bool(f.unattributed),
            ])  # fmt: skip
            for action, when in (d["evidence"].get("actions") or {}).items():
                actions.append([f.finding_id, action, d["job"], d["ranks"], d["hosts"],
                                when.get("step"), when.get("t")])  # fmt: skip
        if not rows:
            return 0
        self._x("BEGIN TRANSACTION")
        try:
            self._many(_UPSERT_FINDING, rows)
            if actions:
                self._many(
                    "INSERT OR IGNORE INTO actions (finding_id, action, job, ranks, hosts, step,"
                    " issued_t) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    actions,
                )
            self._x("COMMIT")
        except Exception:
            self._x("ROLLBACK")
            raise
        return len(rows)

    def upsert_scores(self, columns: dict) -> int:
        """Insert or replace heatmap rows given as columns (``Engine.drain_scores`` items)."""
        n = len(columns["rank"])
        if not n:
            return 0
        table = pa.table(
            {
                "job": pa.array(list(columns["job"]), pa.string()),
                "step": pa.array(columns["step"], pa.int64()),
                "steps": pa.array(columns["steps"], pa.int32()),
                "rank": pa.array(columns["rank"], pa.int32()),
                "metric": pa.array(list(columns["metric"]), pa.string()),
                "score": pa.array(columns["score"], pa.float64()),
            }
        )
        self._x("SELECT 1")  # completes any half-read result others left on this connection
        self.con.register("rankscope_score_rows", table)
        try:
            self._x(
                "INSERT OR REPLACE INTO scores (job, step, steps, rank, metric, score) "
                "SELECT job, step, steps, rank, metric, score FROM rankscope_score_rows"
            )
        finally:
            self.con.unregister("rankscope_score_rows")
        return n

    def record_job(self, summary: dict, source: str | None = None) -> None:
        """Insert or replace a job row from ``Engine.job_summary``."""
        last_t = summary.get("last_t")
        if last_t is not None and not math.isfinite(last_t):
            last_t = None
        self._x(
            "INSERT OR REPLACE INTO jobs (job, world, hosts, last_step, frames, last_t, source,"
            " late, forced, partial_frames, refused, dropped)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [summary["job"], summary.get("world"), summary.get("hosts"),
             summary.get("last_step"), summary.get("frames"), last_t, source,
             summary.get("late"), summary.get("forced"), summary.get("partial_frames"),
             summary.get("refused"), summary.get("dropped")],
        )  # fmt: skip

    def record_bad(self, source: str, errors: Iterable) -> int:
        """Remember malformed input: items with ``file``, ``line``, ``reason`` (e.g. BadLine)."""
        rows = [[source, f"{e.file}:{e.line}", e.reason] for e in errors]
        if rows:
            self._many(
                "INSERT OR REPLACE INTO bad_records (source, location, reason) VALUES (?, ?, ?)",
                rows,
            )
        return len(rows)

    def set_triage(self, finding_id: str, status: str, note: str = "", t: float | None = None):
        """A person's verdict on a finding (``write_triage``'s rules)."""
        write_triage(self.con, finding_id, status, note, t=t)

    def mark_delivered(self, finding_id: str, action: str, t: float) -> None:
        """The control channel delivered ``action`` of a finding at ``t``."""
        self._x(
            "UPDATE actions SET delivered_t = ? WHERE finding_id = ? AND action = ?",
            [t, finding_id, action],
        )

    # -- reads -------------------------------------------------------------
    def list_findings(
        self,
        job: str | None = None,
        kind: str | None = None,
        limit: int | None = None,
    ) -> list[dict]:
        """Findings (trace format shape + finding_id, unattributed, triage), by job and step."""
        params = [job, job, kind, kind, int(limit) if limit is not None else 2**62]
        out = []
        for row in self.con.execute(_LIST_FINDINGS, params).fetchall():
            d = dict(zip(_FINDING_COLS + ("triage",), row, strict=True))
            d["evidence"] = orjson.loads(d["evidence"]) if d["evidence"] else {}
            out.append(d)
        return out

    def list_jobs(self) -> list[dict]:
        cur = self.con.execute("SELECT * FROM jobs ORDER BY job")
        names = [c[0] for c in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def count(self, table: str) -> int:
        """Rows in one of the store's tables (names checked against the schema)."""
        if table not in ("jobs", "findings", "actions", "scores", "triage", "bad_records"):
            raise ValueError(f"unknown table {table!r}")
        return int(self.con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0])  # noqa: S608


def write_triage(con, finding_id: str, status: str, note: str = "", *,
                 t: float | None = None) -> None:  # fmt: skip
    """Store a person's verdict on a finding; ``open`` removes the verdict.

    The one triage writer (the dashboard and ``Store.set_triage`` both call it):
    the status must be one of TRIAGE_CHOICES, the note at most TRIAGE_NOTE_MAX
    characters, and the finding must exist.
    """
    import time

    if status not in TRIAGE_CHOICES:
        raise ValueError(f"triage status must be one of {TRIAGE_CHOICES}, got {status!r}")
    if len(note) > TRIAGE_NOTE_MAX:
        raise ValueError(f"triage note is longer than {TRIAGE_NOTE_MAX:,} characters")
    exists = con.execute("SELECT count(*) FROM findings WHERE finding_id = ?", [finding_id])
    if not exists.fetchone()[0]:
        raise ValueError(f"no finding {finding_id!r} in this store")
    if status == "open":
        con.execute("DELETE FROM triage WHERE finding_id = ?", [finding_id])
        return
    con.execute(
        "INSERT OR REPLACE INTO triage (finding_id, status, note, t) VALUES (?, ?, ?, ?)",
        [finding_id, status, note, time.time() if t is None else float(t)],
    )

"""Offline replay: trace files -> the same engine as online -> findings (and the store).

Replay re-enacts arrival: records are fed in order of their time ``t`` with
the engine on the record clock, so step deadlines and hang timeouts behave
as they did live, whatever order the files hold (one file per rank, shuffled
lines, several record types). JSONL traces are read whole for that sort
(fine for traces up to a few million records); Parquet ``step`` files take
the columnar path and stream batch by batch (records of other types are
read first and interleaved by time), which is what big traces should use.

Each trace path gets its own engine: two traces that both call their job
``run`` do not mix. Malformed lines are counted in the ``ReadReport`` with
file, line and reason, and every valid record is still replayed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.traces.files import ReadReport, iter_records, trace_files

__all__ = ["ReplayResult", "replay_trace", "replay"]

Progress = Callable[[int, int], None]
BATCH_RECORDS = 4096


@dataclass(slots=True)
class ReplayResult:
    """Findings of one or more traces, with what the readers and the assembler saw."""

    findings: list[Finding] = field(default_factory=list)
    report: ReadReport = field(default_factory=ReadReport)
    jobs: list[dict] = field(default_factory=list)
    stats: dict[str, dict] = field(default_factory=dict)


def _is_step_parquet(path: Path) -> bool:
    """A Parquet file of ``step`` records only: those take the columnar path.

    A ``type`` column is checked through the row groups' min/max statistics
    (no data read); without statistics that column alone is read.
    """
    if not path.name.endswith(".parquet"):
        return False
    try:
        pf = pq.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        if not {"rank", "step", "world", "host", "t"} <= names:
            return False
        if "type" not in names:
            return "phase" not in names and "check" not in names
        col = pf.schema_arrow.get_field_index("type")
        for i in range(pf.num_row_groups):
            stats = pf.metadata.row_group(i).column(col).statistics
            if stats is not None and stats.has_min_max and stats.null_count == 0:
                if stats.min == stats.max == "step":
                    continue
                return False
            kinds = pc.unique(pf.read_row_group(i, columns=["type"]).column("type"))
            if kinds.to_pylist() != ["step"]:
                return False
        return True
    except Exception:  # noqa: BLE001 - unreadable: the record path reports it
        return False


def _row_groups(path: Path):
    """Arrow tables of a Parquet file, one row group at a time (memory stays flat).

    ``ParquetFile.iter_batches`` read ahead and kept far more than a batch
    alive on large files; reading whole row groups keeps the peak at one
    group, so writers should keep groups to about a step or a few.
    """
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        yield pf.read_row_group(i)


def _parquet_rows(path: Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001
        return 0


def replay_trace(
    path: str | os.PathLike,
    *,
    engine: Engine | None = None,
    store=None,
    report: ReadReport | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay one trace (directory or file); write to ``store`` when given."""
    engine = engine or Engine(EngineConfig())
    report = report if report is not None else ReadReport()
    files = trace_files(path)
    columnar = [f for f in files if _is_step_parquet(f)]
    others = [f for f in files if f not in columnar]
    found: dict[str, Finding] = {}

    def take(fs: Iterable[Finding]) -> None:
        for f in fs:
            found[f.finding_id] = f

    sub = ReadReport()
    records = list(iter_records(others, sub))
    _merge_report(report, sub)
    records.sort(key=lambda r: r["t"])
    total = len(records) + sum(_parquet_rows(f) for f in columnar)
    done = 0
    if columnar:
        pos = 0
        for f in columnar:
            report.files += 1
            row0 = 0
            try:
                for batch in _row_groups(f):
                    table = _as_table(batch)
                    t_hi = _max_t(table)
                    end = pos
                    while end < len(records) and records[end]["t"] <= t_hi:
                        end += 1
                    if end > pos:
                        take(engine.feed(records[pos:end]))
                        done += end - pos
                        pos = end
                    try:
                        fs, refused = engine.feed_table(table)
                    except ValueError as exc:
                        report.add_error(str(f), row0 + 1, str(exc))
                        fs, refused = [], []
                    take(fs)
                    for row, reason in refused:
                        report.add_error(str(f), row0 + row + 1, reason)
                    report.good["step"] += table.num_rows - len(refused)
                    row0 += table.num_rows
                    done += table.num_rows
                    _drain(engine, store)
                    if progress:
                        progress(done, total)
            except OSError as exc:
                report.add_error(str(f), row0 + 1, f"unreadable Parquet: {exc}")
        records = records[pos:]
    for i in range(0, len(records), BATCH_RECORDS):
        take(engine.feed(records[i : i + BATCH_RECORDS]))
        done += min(BATCH_RECORDS, len(records) - i)
        if progress:
            progress(done, total)
        if i % (BATCH_RECORDS * 16) == 0:
            _drain(engine, store)
    take(engine.flush())
    _drain(engine, store, final=True)
    result = ReplayResult(report=report)
    for job in engine.jobs:
        result.jobs.append(engine.job_summary(job))
        result.stats[job] = engine.stats(job)
    ids = set(found)
    result.findings = [f for f in engine.findings() if f.finding_id in ids]
    if store is not None:
        store.write_turn(findings=result.findings, jobs=result.jobs, source=str(path))
        store.record_bad(str(path), report.errors)
    return result


def replay(
    paths: Iterable[str | os.PathLike],
    *,
    store=None,
    cfg: EngineConfig | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay several traces, each with a fresh engine; results concatenated."""
    out = ReplayResult()
    for p in paths:
        res = replay_trace(p, engine=Engine(cfg), store=store, report=out.report,
                           progress=progress)  # fmt: skip
        out.findings.extend(res.findings)
        out.jobs.extend(res.jobs)
        out.stats.update(res.stats)
    return out


def _merge_report(into: ReadReport, sub: ReadReport) -> None:
    into.good.update(sub.good)
    into.files += sub.files
    into.bad += sub.bad - len(sub.errors)
    for e in sub.errors:
        into.add_error(e.file, e.line, e.reason)


def _as_table(batch):
    return batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])


def _max_t(table) -> float:
    hi = pc.max(table.column("t")).as_py() if "t" in table.column_names else None
    return float(hi) if hi is not None else float("-inf")


def _drain(engine: Engine, store, final: bool = False) -> None:
    rows = engine.drain_scores(final)
    if store is not None:
        store.write_turn(scores=rows)

"""Reading and writing traces: JSONL (plain or gzip) and Parquet.

A trace is a directory (``meta.json``, ``labels.jsonl``, record files) or a
single record file. Trace files are untrusted input: every line is decoded and
validated on its own, a bad line is counted and reported with file, line and
reason, and the valid lines around it are still delivered. Nothing here ever
unpickles anything.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from rankscope.collectors.schema.records import RecordError, record_key, validate_label
from rankscope.pipeline.traces.validate import check_record, parse_json

__all__ = [
    "BadLine",
    "ReadReport",
    "Trace",
    "trace_files",
    "iter_records",
    "trace_jobs",
    "iter_parquet_tables",
    "read_trace",
    "read_meta",
    "read_labels",
    "write_jsonl",
    "write_parquet",
    "write_meta",
    "write_labels",
]

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_SIDE_FILES = {"labels.jsonl", "meta.json"}
MAX_REPORTED_ERRORS = 1000


@dataclass(slots=True)
class BadLine:
    """One record that could not be used, and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(slots=True)
class ReadReport:
    """What a read saw: good records per type and every bad line (first 1000 kept)."""

    good: Counter = field(default_factory=Counter)
    bad: int = 0
    errors: list[BadLine] = field(default_factory=list)
    files: int = 0

    def add_error(self, file: str, line: int, reason: str) -> None:
        self.bad += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BadLine(file, line, reason))

    def summary(self) -> str:
        good = sum(self.good.values())
        parts = [f"{good} records from {self.files} files"]
        if self.bad:
            parts.append(f"{self.bad} malformed skipped")
        return ", ".join(parts)


def trace_files(path: str | os.PathLike) -> list[Path]:
    """The record files of one trace path (a directory or a single file), sorted."""
    p = Path(path)
    if p.is_dir():
        out = [
            f
            for f in sorted(p.rglob("*"))
            if f.is_file() and f.name.endswith(RECORD_SUFFIXES) and f.name not in _SIDE_FILES
        ]
        return out
    if p.is_file():
        if not p.name.endswith(RECORD_SUFFIXES):
            raise ValueError(f"{p}: not a trace file (expected .jsonl, .jsonl.gz or .parquet)")
        return [p]
    raise FileNotFoundError(f"{p}: no such trace file or directory")


def _open_text_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as raw:
        try:
            yield from raw
        except (OSError, EOFError, zlib.error) as exc:  # truncated or corrupt: keep what was read
            raise _Truncated(str(exc)) from exc


class _Truncated(Exception):
    pass


def _iter_jsonl(path: Path, report: ReadReport) -> Iterator[dict]:
    lineno = 0
    try:
        for lineno, line in enumerate(_open_text_lines(path), start=1):
            if not line.strip():
                continue
            try:
                rec = check_record(parse_json(line))
            except ValueError as exc:  # bad JSON or a RecordError: the reason either way
                report.add_error(str(path), lineno, str(exc))
                continue
            report.good[rec["type"]] += 1
            yield rec
    except _Truncated as exc:
        report.add_error(str(path), lineno + 1, f"file truncated or corrupt: {exc}")


def iter_parquet_tables(path: Path, batch_rows: int = 65536):
    """Yield ``pyarrow.Table`` batches of one Parquet record file (row-group streaming)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    yield from pf.iter_batches(batch_size=batch_rows)


def _iter_parquet(path: Path, report: ReadReport) -> Iterator[dict]:
    row = 0
    try:
        for batch in iter_parquet_tables(path):
            for obj in batch.to_pylist():
                row += 1
                obj = {k: v for k, v in obj.items() if v is not None}
                colls = obj.get("collectives")
                if colls:
                    obj["collectives"] = [
                        {k: v for k, v in c.items() if v is not None} for c in colls
                    ]
                try:
                    rec = check_record(obj)
                except RecordError as exc:
                    report.add_error(str(path), row, str(exc))
                    continue
                report.good[rec["type"]] += 1
                yield rec
    except Exception as exc:  # noqa: BLE001 - a corrupt Parquet file is reported, not fatal
        report.add_error(str(path), row + 1, f"unreadable Parquet: {exc}")


def iter_records(paths: Iterable[str | os.PathLike], report: ReadReport) -> Iterator[dict]:
    """Stream validated records from every trace path; bad lines go to ``report``.

    Records come in file order; duplicates are not collapsed here (that needs
    the whole trace in memory; the step assembler keys by rank, so the last
    record of a (job, rank, step) wins there).
    """
    for path in paths:
        for f in trace_files(path):
            report.files += 1
            if f.name.endswith(".parquet"):
                yield from _iter_parquet(f, report)
            else:
                yield from _iter_jsonl(f, report)


def trace_jobs(path: str | os.PathLike) -> set[str]:
    """The jobs a trace holds, from the first good record of each file (a file is one
    rank's or host's stream of one job), without reading the trace whole."""
    jobs = set()
    for f in trace_files(path):
        first = next(iter_records([f], ReadReport()), None)
        if first is not None:
            jobs.add(first["job"])
    return jobs


def read_meta(path: str | os.PathLike) -> dict | None:
    """The trace's ``meta.json`` (beside a single file, or inside a directory)."""
    p = Path(path)
    meta = (p if p.is_dir() else p.parent) / "meta.json"
    if not meta.is_file():
        return None
    try:
        obj = orjson.loads(meta.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{meta}: bad JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{meta}: should hold a JSON object")
    return obj


def read_labels(path: str | os.PathLike, report: ReadReport | None = None) -> list[dict]:
    """Ground-truth labels of a trace directory (empty when it has none)."""
    p = Path(path)
    lab = (p if p.is_dir() else p.parent) / "labels.jsonl"
    if not lab.is_file():
        return []
    out = []
    for lineno, line in enumerate(lab.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(validate_label(orjson.loads(line)))
        except (orjson.JSONDecodeError, RecordError) as exc:
            if report is not None:
                report.add_error(str(lab), lineno, str(exc))
    return out


@dataclass(slots=True)
class Trace:
    """A whole trace in memory, duplicates collapsed (last wins)."""

    records: list[dict]
    labels: list[dict]
    meta: list[dict]
    report: ReadReport


def read_trace(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Trace:
    """Read whole traces; for small and medium traces (tests, sample traces, eval)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    report = ReadReport()
    latest: dict[tuple, dict] = {}
    for rec in iter_records(paths, report):
        latest[record_key(rec)] = rec
    labels: list[dict] = []
    metas: list[dict] = []
    for p in paths:
        labels.extend(read_labels(p, report))
        m = read_meta(p)
        if m is not None:
            metas.append(m)
    return Trace(list(latest.values()), labels, metas, report)


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> int:
    """Write records as JSONL (gzip when the name ends in .gz); returns the count."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if p.name.endswith(".gz") else open
    n = 0
    with opener(p, "wb") as fh:
        for rec in records:
            fh.write(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            fh.write(b"\n")
            n += 1
    return n


def write_parquet(records: Iterable[dict], directory: str | os.PathLike, stem: str = "records"):
    """Write records as Parquet, one file per record type (``<stem>.<type>.parquet``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_type: dict[str, list[dict]] = {}
    for rec in records:
        by_type.setdefault(rec["type"], []).append(rec)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, recs in by_type.items():
        out = d / f"{stem}.{kind}.parquet"
        pq.write_table(pa.Table.from_pylist(recs), out)
        written.append(out)
    return written


def write_meta(directory: str | os.PathLike, meta: dict) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    body = {"format": "rankscope-trace", "v": 1, **meta}
    out = d / "meta.json"
    out.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
    return out


def write_labels(directory: str | os.PathLike, labels: Iterable[dict]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = d / "labels.jsonl"
    with open(out, "wb") as fh:
        for lab in labels:
            fh.write(orjson.dumps(validate_label(dict(lab))) + b"\n")
    return out

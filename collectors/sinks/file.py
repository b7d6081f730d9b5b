"""``file://DIR``: JSON lines on local disk, rotated by size.

Each process writes its own files (``rank00003-p4242-000.jsonl``, the rank
taken from the first record written, the pid keeping restarts apart), so
ranks never contend for one file and a trace directory is simply the union of
them. A file is closed and the next part opened once it reaches
``max_mb`` megabytes (``file://DIR?max_mb=64``, default 64). The background
sender calls ``flush()`` at least once a second and at exit, so a crash loses
at most about a second of records.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs

import orjson

__all__ = ["FileSink"]

DEFAULT_MAX_MB = 64.0


class FileSink:
    """Appends records to size-rotated JSONL files in one directory."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"file sink max size must be >= 1 byte, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._fh = None
        self._written = 0
        self._part = 0
        self._prefix: str | None = None
        self.paths: list[Path] = []

    @classmethod
    def from_url(cls, url: str) -> FileSink:
        if not url.lower().startswith("file://"):
            raise ValueError(f"file sink URL must start with file://, got {url!r}")
        rest = url[len("file://") :]
        path, _, query = rest.partition("?")
        if not path:
            raise ValueError(f"file sink URL {url!r} names no directory (use file://DIR)")
        params = parse_qs(query, strict_parsing=False) if query else {}
        unknown = set(params) - {"max_mb"}
        if unknown:
            raise ValueError(f"file sink URL {url!r}: unknown option(s) {sorted(unknown)}")
        max_mb = DEFAULT_MAX_MB
        if "max_mb" in params:
            try:
                max_mb = float(params["max_mb"][-1])
            except ValueError:
                raise ValueError(f"file sink URL {url!r}: max_mb must be a number") from None
            if not max_mb > 0:
                raise ValueError(f"file sink URL {url!r}: max_mb must be > 0")
        directory = Path(path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"file sink URL {url!r}: cannot create {directory}: {exc}") from exc
        if not os.access(directory, os.W_OK):
            raise ValueError(f"file sink URL {url!r}: directory {directory} is not writable")
        return cls(directory, max_bytes=max(1, int(max_mb * 1024 * 1024)))

    def _open_next(self, first: dict) -> None:
        if self._prefix is None:
            rank = first.get("rank")
            host = first.get("host")
            if isinstance(rank, int):
                self._prefix = f"rank{rank:05d}"
            elif host:
                self._prefix = f"host-{host}"
            else:
                self._prefix = "records"
        if self._fh is not None:
            self._fh.close()
        path = self.directory / f"{self._prefix}-p{os.getpid()}-{self._part:03d}.jsonl"
        self._part += 1
        self._fh = open(path, "ab")  # noqa: SIM115 - lives across calls, closed in close()
        self._written = 0
        self.paths.append(path)

    def send(self, records: list[dict]) -> None:
        for rec in records:
            line = orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
            if self._fh is None or (self._written and self._written + len(line) > self.max_bytes):
                self._open_next(rec)
            self._fh.write(line)
            self._written += len(line)

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

"""Records of a trace in time order, read as a k-way merge over its files.

A trace may hold one file per rank, each in time order (what the collectors
write): merging the files' streams by ``t`` re-creates the order in which the
records happened while holding one record per file in memory, not the trace.
Lines out of order inside one file stay as far out of order as they were; a
record without a usable ``t`` sorts as if it came at the time of the record
before it in its file, so it is neither lost nor moved.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Iterable, Iterator

from rankscope.pipeline.traces.files import ReadReport, iter_records, trace_files

__all__ = ["iter_records_by_time"]


def _keyed(records: Iterator[dict], fileno: int) -> Iterator[tuple[float, int, int, dict]]:
    last = -math.inf
    for seq, rec in enumerate(records):
        t = rec.get("t")
        if isinstance(t, int | float) and math.isfinite(t):
            last = float(t)
        yield last, fileno, seq, rec  # (t, file, line) is unique: dicts are never compared


def iter_records_by_time(paths: Iterable[str | os.PathLike], report: ReadReport
                         ) -> Iterator[dict]:  # fmt: skip
    """Validated records of every trace path, merged by ``t`` across files (bad lines
    to ``report``, as ``iter_records`` does). Memory: one record per file."""
    files = [f for p in paths for f in trace_files(p)]
    streams = [_keyed(iter_records([f], report), i) for i, f in enumerate(files)]
    for _t, _i, _s, rec in heapq.merge(*streams):
        yield rec

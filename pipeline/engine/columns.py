"""Step records as columns: from dicts or Arrow tables to chunks, and chunks to a StepFrame.

The assembler buffers the records of a pending step as *column chunks*
(``dict[str, np.ndarray]``, one entry per field). Online records (dicts) are
turned into one chunk when the step is built; Parquet/Arrow batches are cut
into per-step chunks with whole-array operations, so the columnar path never
touches a record in Python. ``build_frame`` concatenates a step's chunks,
keeps the last record of each rank (duplicates: last wins), sorts by rank
and computes the peer groups.
"""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rankscope.detectors.frame import COORD_NAMES, METRIC_COLUMNS, StepFrame
from rankscope.pipeline.engine.nonfinite_named import apply_named
from rankscope.pipeline.traces.validate import DEFAULT_LIMITS, Limits, array_rejects

__all__ = [
    "REQUIRED_STEP_FIELDS",
    "chunk_from_records",
    "chunk_from_columns",
    "split_step_table",
    "build_frame",
    "PeerGroups",
]

REQUIRED_STEP_FIELDS = ("job", "rank", "step", "world", "host", "t")
_NON_DP = tuple(c for c in COORD_NAMES if c != "dp")


def _object_array(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: lists must not broadcast
        out[i] = v
    return out


def _numbers(recs: list[dict], names: list[str]) -> np.ndarray:
    """Fields ``names`` of every record as float64 rows ``[field, record]`` (absent: NaN).

    One C-level pass (``itemgetter`` over all names) when every record carries
    them all, the usual case; else one ``dict.get`` pass a field.
    """
    out = np.empty((len(names), len(recs)), dtype=np.float64)
    if not names:
        return out
    try:
        rows = np.array(list(map(itemgetter(*names), recs)), dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        rows = None
    if rows is not None and rows.shape == ((len(recs), len(names)) if len(names) > 1 else
                                           (len(recs),)):  # fmt: skip
        out[:] = rows.reshape(len(recs), len(names)).T
        return out
    for i, name in enumerate(names):
        out[i] = np.array(list(map(dict.get, recs, repeat(name))), dtype=np.float64)
    return out


def _strings_of(recs: list[dict], name: str) -> np.ndarray:
    """A string field (validated: str or absent) as an object array."""
    return np.array(list(map(dict.get, recs, repeat(name))), dtype=object)


def chunk_from_records(recs: list[dict]) -> dict[str, np.ndarray]:
    """Columns of validated ``step`` records (absent numbers NaN, absent coords -1).

    Only fields some record carries are read record by record (the union of
    keys is one C-level pass), all numeric ones in one ``itemgetter`` pass;
    the rest are filled whole.
    """
    n = len(recs)
    present = set().union(*recs) - {"nonfinite_named"}  # derived below, never read
    ch: dict[str, np.ndarray] = {
        "rank": np.fromiter(map(itemgetter("rank"), recs), np.int64, n),
        "world": np.fromiter(map(itemgetter("world"), recs), np.int64, n),
        "host": _strings_of(recs, "host"),
    }
    ch["param_digest"] = (
        _strings_of(recs, "param_digest")
        if "param_digest" in present
        else np.full(n, None, dtype=object)
    )
    coords = [c for c in COORD_NAMES if c in present]
    metrics = [m for m in METRIC_COLUMNS if m in present]
    cols = _numbers(recs, coords + metrics)
    for i, c in enumerate(coords):
        v = cols[i]
        ch[c] = np.where(np.isnan(v), -1, v).astype(np.int64)
    for c in COORD_NAMES:
        if c not in ch:
            ch[c] = np.full(n, -1, dtype=np.int64)
    for i, m in enumerate(metrics, start=len(coords)):
        ch[m] = cols[i]
    for m in METRIC_COLUMNS:
        if m not in ch:
            ch[m] = np.full(n, np.nan)
    if "collectives" in present:
        ch["collectives"] = _object_array(list(map(dict.get, recs, repeat("collectives"))))
    if "nonfinite_fields" in present:
        apply_named(ch, list(map(dict.get, recs, repeat("nonfinite_fields"))))
    return ch


def chunk_from_columns(cols: dict[str, list], n: int) -> dict[str, np.ndarray]:
    """The chunk of ``chunk_from_records`` from per-field value lists of ``n`` valid
    ``step`` records that all carry the same fields (``bus_decode.uniform_columns``):
    one array conversion a field, no pass over records. Raises OverflowError when an
    int does not fit int64."""
    ch: dict[str, np.ndarray] = {
        "rank": np.array(cols["rank"], dtype=np.int64),
        "world": np.array(cols["world"], dtype=np.int64),
        "host": np.array(cols["host"], dtype=object),  # validated str: nothing to broadcast
    }
    digest = cols.get("param_digest")
    ch["param_digest"] = (
        np.array(digest, dtype=object) if digest is not None else np.full(n, None, dtype=object)
    )
    for c in COORD_NAMES:
        v = cols.get(c)
        ch[c] = np.array(v, dtype=np.int64) if v is not None else np.full(n, -1, dtype=np.int64)
    for m in METRIC_COLUMNS:
        v = cols.get(m) if m != "nonfinite_named" else None  # derived below, never read
        ch[m] = np.array(v, dtype=np.float64) if v is not None else np.full(n, np.nan)
    if "collectives" in cols:
        ch["collectives"] = _object_array(cols["collectives"])
    if "nonfinite_fields" in cols:
        apply_named(ch, cols["nonfinite_fields"])
    return ch


def _one_chunk(col):
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _strings(col, cache: dict | None = None, key: str = "") -> tuple[np.ndarray, int]:
    """An Arrow string column as an object array (and its number of distinct values).

    ``cache`` remembers the last column per ``key``: host names repeat step
    after step, so an equal column (a memcmp) reuses the last result.
    """
    col = _one_chunk(col)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0].equals(col):
            return hit[1], hit[2]
    out, distinct = None, 0
    if col.null_count == 0 and len(col):
        lo_hi = pc.min_max(col)
        lo, hi = lo_hi["min"].as_py(), lo_hi["max"].as_py()
        if lo == hi:
            out, distinct = np.full(len(col), lo, dtype=object), 1
    if out is None:
        enc = _one_chunk(pc.dictionary_encode(col))
        idx = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        words = np.array(enc.dictionary.to_pylist() + [None], dtype=object)
        out, distinct = words[idx], len(enc.dictionary)
    if cache is not None:
        cache[key] = (col, out, distinct)
    return out, distinct


def _floats(col) -> np.ndarray:
    col = _one_chunk(col)
    if col.type == pa.float64() and col.null_count == 0:
        return col.to_numpy()
    return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _ints(col, fill: int) -> np.ndarray:
    col = _one_chunk(col)
    if col.type == pa.int64() and col.null_count == 0:
        return col.to_numpy()
    return pc.cast(pc.fill_null(col, fill), pa.int64()).to_numpy(zero_copy_only=False)


def split_step_table(table, world_cap: int | None = None, cache: dict | None = None):
    """Cut an Arrow table of ``step`` records into per-(job, step) column chunks.

    Returns ``(chunks, bad)``: ``chunks`` is a list of ``(job, step, chunk)``
    in table order; ``bad`` lists ``(row, reason)`` for rows that break the
    schema (missing required field, unknown version, rank outside the world).
    Raises ``ValueError`` when the table as a whole cannot be used (a required
    column is absent or has the wrong type). ``cache`` (any dict kept by the
    caller) lets repeated string columns such as hosts skip their decoding.
    """
    names = set(table.column_names)
    absent = [f for f in REQUIRED_STEP_FIELDS if f not in names]
    if absent:
        raise ValueError(f"step table lacks required column(s) {', '.join(absent)}")
    n = table.num_rows
    valid = np.ones(n, dtype=bool)
    reasons: dict[int, str] = {}

    def reject(mask: np.ndarray, reason: str) -> None:
        for i in np.flatnonzero(mask & valid):
            reasons[int(i)] = reason
        valid[mask] = False

    for f in REQUIRED_STEP_FIELDS:
        col = table.column(f)
        if col.null_count:
            reject(pc.is_null(col).to_numpy(zero_copy_only=False), f"missing required field '{f}'")
    if "v" in names:
        v = _floats(table.column("v"))
        reject(v != 1, "unknown format version (this reader knows v=1)")
    try:
        rank = _ints(table.column("rank"), -1)
        step = _ints(table.column("step"), -1)
        world = _ints(table.column("world"), 0)
        t = _floats(table.column("t"))
    except pa.ArrowException as exc:  # invalid, type or unsupported-cast errors alike
        raise ValueError(f"step table has a column of the wrong type: {exc}") from exc
    limits = DEFAULT_LIMITS if world_cap is None else Limits(max_world=world_cap)
    checked = {"rank": rank, "world": world, "step": step, "t": t}
    for c in _NON_DP + ("dp",):
        if c in names:
            checked[c] = _ints(table.column(c), -1)
    for f in ("job", "host", "param_digest"):
        if f in names and pa.types.is_string(table.column(f).type):
            checked[f"len:{f}"] = pc.fill_null(pc.utf8_length(table.column(f)), 0).to_numpy(
                zero_copy_only=False)  # fmt: skip
    for mask, reason in array_rejects(checked, limits):  # the one validation entry's bounds
        reject(mask, reason)
    bad = sorted(reasons.items())

    ch: dict[str, np.ndarray] = {"rank": rank, "world": world, "t": t}
    jobs, n_jobs = _strings(table.column("job"), cache, "job")
    ch["host"] = _strings(table.column("host"), cache, "host")[0]
    for c in COORD_NAMES:
        ch[c] = _ints(table.column(c), -1) if c in names else np.full(n, -1, dtype=np.int64)
    for m in METRIC_COLUMNS:
        if m == "t":
            continue
        read = m in names and m != "nonfinite_named"  # derived below, never read
        ch[m] = _floats(table.column(m)) if read else np.full(n, np.nan)
    ch["param_digest"] = (
        _strings(table.column("param_digest"))[0] if "param_digest" in names else None
    )
    if "collectives" in names and table.column("collectives").null_count < n:
        ch["collectives"] = _object_array(table.column("collectives").to_pylist())
    if "nonfinite_fields" in names and table.column("nonfinite_fields").null_count < n:
        apply_named(ch, table.column("nonfinite_fields").to_pylist())

    keep = np.flatnonzero(valid)
    if keep.size < n:
        jobs, step = jobs[keep], step[keep]
        ch = {k: (a[keep] if a is not None else None) for k, a in ch.items()}
    if ch["param_digest"] is None:
        ch["param_digest"] = np.full(keep.size, None, dtype=object)
    chunks = []
    if keep.size == 0:
        return chunks, bad
    single_job = n_jobs == 1 or bool((jobs == jobs[0]).all())
    if single_job and bool((step[1:] >= step[:-1]).all()):
        cuts = np.flatnonzero(step[1:] != step[:-1]) + 1
        bounds = np.concatenate(([0], cuts, [step.size]))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            chunks.append((jobs[0], int(step[a]), {k: v[a:b] for k, v in ch.items()}))
        return chunks, bad
    job_codes = np.unique(jobs.astype(str), return_inverse=True)[1]
    order = np.lexsort((np.arange(step.size), step, job_codes))
    js, ss = job_codes[order], step[order]
    cuts = np.flatnonzero((js[1:] != js[:-1]) | (ss[1:] != ss[:-1])) + 1
    bounds = np.concatenate(([0], cuts, [order.size]))
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        idx = order[a:b]
        chunks.append((jobs[idx[0]], int(step[idx[0]]), {k: v[idx] for k, v in ch.items()}))
    return chunks, bad


class PeerGroups:
    """Peer-group ids (same coordinates except dp), cached while the layout stays the same."""

    __slots__ = ("_key", "_group")

    def __init__(self) -> None:
        self._key: np.ndarray | None = None
        self._group: np.ndarray | None = None

    def __call__(self, coords: dict[str, np.ndarray]) -> np.ndarray:
        key = np.zeros(coords["tp"].shape[0], dtype=np.int64)
        for c in _NON_DP:
            v = coords[c]
            key = key * (int(v.max()) + 1 if v.size else 1) + v
        if self._key is not None and np.array_equal(self._key, key):
            return self._group
        self._group = np.unique(key, return_inverse=True)[1].astype(np.int64).reshape(-1)
        self._key = key
        return self._group


def build_frame(
    job: str,
    step: int,
    world: int,
    chunks: list[dict[str, np.ndarray]],
    seen: np.ndarray,
    groups: PeerGroups,
) -> StepFrame:
    """One StepFrame from a step's chunks (arrival order): last record per rank wins."""
    if len(chunks) == 1:
        cols = chunks[0]
    else:
        keys = set().union(*chunks)
        cols = {}
        for k in keys:
            parts = [c[k] if c.get(k) is not None else _blank(k, c["rank"].size) for c in chunks]
            cols[k] = np.concatenate(parts)
    rank = cols["rank"]
    n = rank.size
    if n and (n != int(np.count_nonzero(seen)) or not bool((rank[1:] > rank[:-1]).all())):
        cols = _last_per_rank(cols, rank)
        rank = cols["rank"]
    coords = {}
    for c in COORD_NAMES:
        v = cols[c]
        default = rank if c == "dp" else 0
        coords[c] = np.where(v < 0, default, v) if (v < 0).any() else v
    m = {k: cols[k] for k in METRIC_COLUMNS}
    colls = cols.get("collectives")
    missing = np.flatnonzero(~seen[:world])
    if seen.size < world:  # the world grew after this step opened
        missing = np.concatenate([missing, np.arange(seen.size, world)])
    return StepFrame(
        job=job,
        step=step,
        world=world,
        rank=rank,
        host=cols["host"],
        group=groups(coords),
        coords=coords,
        m=m,
        digest=cols["param_digest"],
        collectives=list(colls) if colls is not None else None,
        missing=missing.astype(np.int64),
    )


def _last_per_rank(cols: dict[str, np.ndarray], rank: np.ndarray) -> dict[str, np.ndarray]:
    """One row per rank, sorted by rank: each field's value from the last record of the
    rank that carried it. A duplicate lacking a field (absent, null or NaN) does not
    overwrite what an earlier record of the same rank and step said: a writer on the
    telemetry topic could otherwise fake a non-finite loss for a rank that reported a
    finite one (docs/trace-format.md, "Duplicates")."""
    n = rank.size
    order = np.lexsort((np.arange(n), rank))  # by rank, then arrival
    r = rank[order]
    starts = np.flatnonzero(np.concatenate(([True], r[1:] != r[:-1])))
    last = np.concatenate((starts[1:], [n])) - 1  # each rank's last row (sorted positions)
    out = {}
    for k, v in cols.items():
        if v is None:
            continue
        v = v[order]
        if k == "rank" or starts.size == n:
            out[k] = v[last]
            continue
        if v.dtype == object:
            present = v != None  # noqa: E711 - elementwise on an object array
        elif v.dtype.kind == "f":
            present = ~np.isnan(v)
        elif k in COORD_NAMES:
            present = v >= 0
        else:
            present = np.ones(n, dtype=bool)
        pos = np.where(present, np.arange(n), -1)
        best = np.maximum.reduceat(pos, starts)
        out[k] = v[np.where(best >= 0, best, last)]
    return out


def _blank(key: str, n: int) -> np.ndarray:
    if key in COORD_NAMES:
        return np.full(n, -1, dtype=np.int64)
    if key in ("host", "param_digest", "collectives"):
        return np.full(n, None, dtype=object)
    return np.full(n, np.nan)

"""Flight Recorder import bounded in time and memory: the cases of issue 17, on real dumps."""

from __future__ import annotations

import pickle
import shutil
import time
import tracemalloc

import pytest
from rankscope.pipeline.importers.flight_recorder import (
    MAX_RANKS_TEXT,
    MAX_WORLD,
    _members,
    load_dumps,
)
from rankscope.pipeline.importers.flight_recorder_beats import (
    MAX_BEATS_PER_RANK,
    dumps_to_records,
)
from rankscope.pipeline.importers.safe_unpickle import safe_loads
from support.paths import ROOT

_CANDIDATES = [p / "shared" / "data" / "flight-recorder" for p in (ROOT.parent, ROOT.parents[1])]
FR_DATA = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
needs_dumps = pytest.mark.skipif(not FR_DATA.is_dir(), reason=f"real dumps absent ({FR_DATA})")


def _copy(tmp_path, case="lock_gil_1st"):
    d = tmp_path / case
    shutil.copytree(FR_DATA / case, d)
    return d


def _bounded(fn):
    tracemalloc.start()
    t0 = time.monotonic()
    out = fn()
    wall = time.monotonic() - t0
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert wall < 20 and peak < 400e6, (wall, peak)
    return out


@needs_dumps
@pytest.mark.parametrize("name", ["_dump_10000000", "_dump_1000000000000", "_dump_60000"])
def test_a_renamed_dump_does_not_make_the_world(tmp_path, name):
    d = _copy(tmp_path)
    shutil.copy(d / "_dump_3", d / name)
    dumps, report = _bounded(lambda: load_dumps(d))
    assert report.world == 16 and sorted(dumps) == list(range(16))
    assert name in report.corrupt and "rank" in report.corrupt[name]
    recs, meta = dumps_to_records(dumps, report, "fr")
    assert meta["world"] == 16 and {r.get("world") for r in recs} <= {16, None}
    assert {r["rank"] for r in recs} == set(range(16))


def _with_members(d, ranks):
    for f in d.glob("_dump_*"):
        obj = safe_loads(f.read_bytes())
        for cfg in obj["pg_config"].values():
            cfg["ranks"] = ranks
        f.write_bytes(pickle.dumps(obj))


@needs_dumps
def test_a_huge_declared_member_is_dropped_not_allocated(tmp_path):
    d = _copy(tmp_path)
    _with_members(d, str(list(range(16)) + [9_999_999]))
    dumps, report = _bounded(lambda: load_dumps(d))
    assert report.world == 16 and len(dumps) == 16
    assert any(f"past {MAX_WORLD}" in n for n in report.notes)


@needs_dumps
def test_a_megabytes_long_member_text_is_refused_cheaply(tmp_path):
    d = _copy(tmp_path)
    _with_members(d, "[" + "0, " * 1_500_000 + "1]")  # ~4.5 MB a dump, once 1.9 GB of objects
    dumps, report = _bounded(lambda: load_dumps(d))
    assert len(dumps) == 16 and report.world == 16
    assert any("not a list of ranks" in n for n in report.notes)


def test_member_text_parser_is_bounded_and_exact():
    assert _members("[0, 1, 2]") == (0, 1, 2)
    assert _members("(4,)") == (4,)
    assert _members("[]") == ()
    for bad in ("[0, 1, x]", "__import__('os')", "[1" + " " * 400_000 + "x", "[" * 10_000,
                "[" + "9" * 11 + "]", "x" * (MAX_RANKS_TEXT + 1)):  # fmt: skip
        t0 = time.monotonic()
        assert _members(bad) == ()
        assert time.monotonic() - t0 < 1.0


@needs_dumps
def test_a_claimed_watchdog_span_does_not_make_endless_beats(tmp_path):
    d = _copy(tmp_path)
    for f in d.glob("_dump_*"):
        obj = safe_loads(f.read_bytes())
        for e in obj["entries"]:
            e["timeout_ms"] = 10**15
        f.write_bytes(pickle.dumps(obj))
    dumps, report = load_dumps(d)
    recs, _meta = _bounded(lambda: dumps_to_records(dumps, report, "fr"))
    per_rank = max(sum(1 for r in recs if r["rank"] == k) for k in dumps)
    assert per_rank <= MAX_BEATS_PER_RANK + 50

"""``nonfinite_fields``: a null the record names non-finite is evidence, a bare null a gap.

Rank 2 never reported a loss before step 8 (so the old "reported before" rule
cannot tell its null from a gap); at step 8 its record says ``"loss": null,
"nonfinite_fields": {"loss": "NaN"}``, as the rank collector writes it. Every
input path (dict records, Arrow tables, bus columns) must give the nonfinite
finding on rank 2 at step 8; without the name, nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from rankscope.pipeline.engine.columns import chunk_from_columns, chunk_from_records
from rankscope.pipeline.engine.engine import Engine
from support.engine_synth import make_records


def _records(named: dict | None) -> list[dict]:
    recs = make_records(steps=14, dp=4, tp=1)
    for r in recs:
        if r["rank"] == 2 and r["step"] < 8:
            del r["loss"]
        if r["rank"] == 2 and r["step"] == 8:
            r["loss"] = None
            if named:
                r["nonfinite_fields"] = named
    return recs


def _nonfinite(findings):
    return [(f.kind, f.ranks, f.first_step, f.action) for f in findings if f.kind == "nonfinite"]


@pytest.mark.parametrize("path", ["records", "table"])
def test_a_named_null_is_non_finite_evidence_on_every_path(path):
    for named, want in (({"loss": "NaN"}, [("nonfinite", [2], 8, "recover")]),
                        ({"loss": "Infinity"}, [("nonfinite", [2], 8, "recover")]),
                        (None, [])):  # fmt: skip
        recs, eng = _records(named), Engine()
        if path == "records":
            eng.feed(recs)
        else:
            keys = {k for r in recs for k in r}  # from_pylist reads the first row's keys
            table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in recs])
            _, refused = eng.feed_table(table)
            assert refused == []
        eng.flush()
        assert _nonfinite(eng.findings()) == want, (path, named)


def test_the_columns_carry_the_value_and_the_name():
    rows = [{"rank": 0, "world": 2, "host": "h", "loss": None, "grad_norm": None,
             "nonfinite_fields": {"loss": "NaN", "grad_norm": "-Infinity", "lr": "NaN"}},
            {"rank": 1, "world": 2, "host": "h", "loss": 2.0, "grad_norm": None,
             "nonfinite_fields": {"loss": "NaN", "grad_norm": "bogus"}}]  # fmt: skip
    for ch in (chunk_from_records(rows),
               chunk_from_columns({k: [r[k] for r in rows] for k in rows[0]}, 2)):  # fmt: skip
        assert math.isnan(ch["loss"][0]) and ch["loss"][1] == 2.0  # a value there wins
        assert ch["grad_norm"][0] == -math.inf and math.isnan(ch["grad_norm"][1])
        assert ch["nonfinite_named"].tolist() == [1 | 2, 0]  # lr is no frame column
    plain = chunk_from_records([{k: v for k, v in rows[1].items() if k != "nonfinite_fields"}])
    assert np.isnan(plain["nonfinite_named"]).all()  # no name: nothing named, no zeros

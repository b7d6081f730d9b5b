"""Fuzzing the one validation entry (hypothesis, a fixed budget, derandomized so every run
tries the same cases): whatever a record says, the lanes agree with ``check_record``, refuse
only with ``RecordError``/``ValueError``, and what they accept the engine, the checkpoint
writer and DuckDB can all hold."""

from __future__ import annotations

import copy
import json

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.collectors.schema.records import SCHEMA, RecordError
from rankscope.pipeline.bus.decode import decode_message, decode_records
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.serve.guard import dump_state
from rankscope.pipeline.traces.validate import bounds_reason, check_record, columns_bounds_reason
from support.engine_synth import one_step_record as _step

BUDGET = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

edge_ints = st.sampled_from([0, 1, -1, 3, 2**31, 2**62, 2**63 - 1, 2**63, -(2**63) - 1,
                             2**64 - 1, 10**29, 65_535, 65_536, 1 << 20])  # fmt: skip
values = st.one_of(
    edge_ints,
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e29, 3.0, -0.0, 1e300]),
    st.text(max_size=8),
    st.text(min_size=1000, max_size=1100),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
fields = st.sampled_from(sorted({*SCHEMA["step"], "v", "type", "job", "extra"}))
mutations = st.lists(st.tuples(fields, values), max_size=4)


def _mutated(muts, **base):
    rec = _step(**base)
    for name, value in muts:
        rec[name] = value
    return rec


def _verdict(rec):
    try:
        return check_record(copy.deepcopy(rec))
    except RecordError:
        return None


@BUDGET
@given(mutations)
def test_check_record_refuses_only_with_a_reason(muts):
    rec = _mutated(muts)
    try:
        ok = check_record(copy.deepcopy(rec))
    except RecordError as exc:
        assert str(exc)
        return
    assert bounds_reason(ok) is None
    orjson.dumps(ok)  # every accepted int fits 64 bits: the writers can hold it


@settings(BUDGET, max_examples=150)
@given(st.lists(mutations, min_size=1, max_size=40), st.booleans())
def test_the_kafka_lane_agrees_with_the_entry(batch, as_array):
    recs = [_mutated(m, rank=i % 4, step=i // 4) for i, m in enumerate(batch)]
    value = json.dumps(recs if as_array or len(recs) > 1 else recs[0]).encode()
    wire = json.loads(value)  # what the lane sees (json writes NaN tokens and big ints)
    wire = wire if isinstance(wire, list) else [wire]
    want = [r for r in (_verdict(orjson_like(w)) for w in wire) if r is not None]
    good, bad = [], []
    try:
        decoded = decode_message(value, good, bad, min_columns=8)
    except ValueError:
        return  # the value as a whole is unusable (only when not JSON at all)
    if decoded is not None:
        assert decoded.n == len(wire) and not bad and len(want) == len(wire)
        return
    assert len(good) == len(want) and len(good) + len(bad) == len(wire)
    good2, bad2 = [], []
    decode_records(value, good2, bad2)
    assert len(good2) == len(good)


def orjson_like(rec):
    """orjson reads an int past 64 bits as a float: judge what the lane really holds."""
    if not isinstance(rec, dict):
        return rec
    return {k: (float(v) if type(v) is int and not -(2**63) <= v < 2**64 else v)
            for k, v in rec.items()}  # fmt: skip


@settings(BUDGET, max_examples=60)  # an engine a case: the dearest property
@given(st.lists(mutations, min_size=1, max_size=24))
def test_what_is_accepted_the_engine_and_checkpoint_can_hold(batch):
    recs = [r for r in (_verdict(_mutated(m, rank=i % 4, step=i // 4))
                        for i, m in enumerate(batch)) if r is not None]  # fmt: skip
    eng = Engine()
    eng.feed(recs)
    eng.feed(recs[::-1])
    eng.flush()
    dump_state(eng.state_dict())
    for job in eng.jobs:
        summary = eng.job_summary(job)
        assert summary["last_step"] is None or 0 <= summary["last_step"] < 2**63


@BUDGET
@given(st.lists(st.tuples(st.sampled_from([0, 1, 3, 2**63, -1]), st.sampled_from(
    [1, 4, 65_536, 65_537]), st.sampled_from([0.0, 1e12, float("nan")])), min_size=1,
    max_size=6))  # fmt: skip
def test_column_bounds_agree_with_record_bounds(rows):
    recs = [_step(rank=r, world=w, t=t) for r, w, t in rows]
    cols = {k: [rec[k] for rec in recs] for k in recs[0]}
    per_record = all(bounds_reason(rec) is None for rec in recs)
    assert (columns_bounds_reason("step", cols) is None) == per_record

"""The service's columnar path (no broker): batched step messages decoded straight into
columns must give what the record path gives, record for record and finding for finding;
and the writer thread stores in order and hands a failure back to the loop."""

from __future__ import annotations

import copy
import json

import numpy as np
import orjson
import pytest
from rankscope.collectors.schema.records import RecordError
from rankscope.pipeline.bus.decode import StepBatch, decode_message, decode_records
from rankscope.pipeline.bus.kafka import encode_records
from rankscope.pipeline.engine.columns import chunk_from_records
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.serve.db import ServeDb
from rankscope.pipeline.serve.writer import ServeWriter, WriteJob
from rankscope.pipeline.traces.validate import check_record
from support.engine_synth import make_records
from support.engine_synth import one_step_record as _step


def _messages(records, size):
    return [encode_records(records[i : i + size]) for i in range(0, len(records), size)]


def _serve_like(values, engine, refused=None):
    """What ``Service._consume`` does with message values: columns when it can.
    ``refused`` collects the reasons of records the validation entry refused (else none may be)."""
    columns = 0
    for v in values:
        good, bad = [], []
        batch = decode_message(v, good, bad)
        if refused is None:
            assert not bad
        else:
            refused.extend(reason for _i, reason, _rec in bad)
        if batch is not None:
            columns += 1
            engine.feed_columns(batch.job, batch.step, batch.chunk)
        elif good:
            engine.feed(good)
    engine.flush()
    return columns


def _checked(rec):
    try:
        return check_record(rec)
    except RecordError:
        return None


def _summary(engine):
    findings = {(f.finding_id, f.kind, tuple(f.ranks), f.first_step, f.last_step, f.action)
                for f in engine.findings()}  # fmt: skip
    return findings, {job: engine.stats(job) for job in engine.jobs}


def test_columns_give_the_records_findings_and_counters():
    a = make_records(job="col-a", dp=8, tp=2, steps=60, ranks_per_host=4, straggler=(5, 25, 2.0))
    b = make_records(job="col-b", dp=8, tp=1, steps=60, ranks_per_host=2, digest_flip=(3, 40))
    # blocks of 4 steps of one job, then of the other: runs long enough for columns
    records = sorted(a + b, key=lambda r: (r["step"] // 4, r["job"], r["step"], r["rank"]))
    # the awkward cases too: records of an open step twice (duplicates), a built step
    # again (late), a rank outside the world (refused), one message of both jobs
    i = records.index(a[16 * 12 + 7]) + 1  # step 12, ranks 0-7 twice while it is open
    records[i:i] = [dict(r) for r in a[16 * 12 : 16 * 12 + 8]]
    records += [dict(r) for r in a[16 * 30 : 16 * 31]]
    records += [{**a[0], "step": 59, "rank": 99}, {**a[0], "step": 2}]
    records += [dict(b[-1]), dict(a[-1])]

    messages = _split_by_job(records, 40)
    ref = Engine()  # the record path, message by message, through the one validation entry
    for m in messages:
        ref.feed([r for r in (_checked(copy.deepcopy(r)) for r in m) if r is not None])
    ref.flush()
    eng = Engine()
    refused: list[str] = []
    columns = _serve_like([encode_records(m) for m in messages], eng, refused)
    assert columns > 10  # the columnar path really ran
    assert _summary(eng) == _summary(ref)
    assert {f[1] for f in _summary(eng)[0]} == {"straggler", "sdc"}
    counters = _summary(eng)[1]["col-a"]
    # the rank outside the world is refused by validation now, before the assembler sees it
    assert refused == ["rank 99 outside 0..15"]
    assert (counters["duplicates"], counters["late"], counters.get("refused", 0)) == (8, 18, 0)
    ref_scores, scores = ref.drain_scores(final=True), eng.drain_scores(final=True)
    assert len(scores) == len(ref_scores)
    for got, want in zip(scores, ref_scores, strict=True):
        for k in want:
            assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), k


def _split_by_job(records, size):
    """Messages of up to ``size`` consecutive records of one job, like ``rankscope publish``,
    plus the last two records (two jobs) as one mixed message."""
    body, tail = records[:-2], records[-2:]
    out, buf = [], []
    for r in body:
        if buf and (r["job"] != buf[0]["job"] or len(buf) >= size):
            out.append(buf)
            buf = []
        buf.append(r)
    return [*out, buf, tail]


def test_a_uniform_message_becomes_the_chunk_of_its_records():
    recs = make_records(job="c", dp=40, tp=1, steps=2, ranks_per_host=8)
    good, bad = [], []
    batch = decode_message(orjson.dumps(recs), good, bad)
    assert isinstance(batch, StepBatch) and not good and not bad
    assert batch.job == "c" and batch.n == len(recs) and list(batch.step) == [0] * 40 + [1] * 40
    want = chunk_from_records(recs)
    for k, v in want.items():
        got = batch.chunk[k]
        assert got.dtype == v.dtype, k
        assert np.array_equal(got, v, equal_nan=v.dtype.kind == "f"), k


def test_columns_only_for_what_the_record_path_accepts_unchanged():
    base = [_step(rank=i % 4) for i in range(40)]
    variants = [{}]
    for key in list(_step()):
        for value in (None, "x", 1.5, 2.0, True, [], 7, 2**70):
            variants.append({key: value})
    columns = 0
    for over in variants:
        recs = copy.deepcopy(base)
        recs[17] = {**recs[17], **over}
        value = json.dumps(recs).encode()
        want_good, want_bad = [], []
        decode_records(value, want_good, want_bad)
        good, bad = [], []
        batch = decode_message(value, good, bad)
        if batch is None:  # the record path, verdict for verdict
            assert (len(good), len(bad)) == (len(want_good), len(want_bad)), over
            continue
        # columns only when every record passed unchanged, and the values are theirs
        assert not want_bad and not good and not bad and batch.n == 40, over
        assert want_good == recs, over
        assert int(batch.chunk["rank"][17]) == want_good[17]["rank"]
        columns += 1
    assert columns >= 5  # e.g. unchanged, an int time, another rank or step


def test_small_messages_stay_records():
    good, bad = [], []
    assert decode_message(orjson.dumps([_step()] * 8), good, bad) is None
    assert len(good) == 8 and not bad


def test_the_writer_stores_in_order_and_hands_a_failure_back(tmp_path):
    from rankscope.pipeline.serve.config import ServeStats

    db = ServeDb(str(tmp_path / "w.duckdb"))
    writer = ServeWriter(db, None, None, group="g", stats=ServeStats())
    try:
        for off in (10, 20, 30):  # checkpoints of one partition: the last one stays
            writer.submit(WriteJob(checkpoints=[("topic", 0, off, f'{{"at": {off}}}')]))
        writer.drain()
        with db.session() as s:
            assert s.tables.load_checkpoint("g", "topic", 0) == (30, '{"at": 30}')
        writer.submit(WriteJob(checkpoints=[("topic", 0, "not an offset", None)]))
        with pytest.raises(RuntimeError, match="serve writer failed"):
            writer.drain()
        with pytest.raises(RuntimeError, match="serve writer failed"):
            writer.submit(WriteJob())
        with db.session() as s:  # nothing after the failure was written over it
            assert s.tables.load_checkpoint("g", "topic", 0) == (30, '{"at": 30}')
    finally:
        with pytest.raises(RuntimeError):
            writer.close()
        db.close()

"""Poison containment in serve's parts that need no broker: the writer, checkpoints, the
partition's step bookkeeping, wrong-topic records, and the demo's embedded lane."""

from __future__ import annotations

import json
import math

from rankscope.pipeline.demo import _checked
from rankscope.pipeline.engine.assemble import AssemblerConfig
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.serve.config import ServeStats
from rankscope.pipeline.serve.db import ServeDb
from rankscope.pipeline.serve.guard import dump_state, misrouted, tick_guarded
from rankscope.pipeline.serve.partition import PartitionState
from rankscope.pipeline.serve.writer import ServeWriter, WriteJob
from rankscope.pipeline.traces.validate import parse_json
from support.engine_synth import make_records
from support.engine_synth import one_step_record as _step


def _finding(first: int, ranks=(1,)) -> Finding:
    return Finding(job="j", kind="straggler", ranks=list(ranks), hosts=["h0"], first_step=first,
                   last_step=first, detected_step=first, detected_t=1.0, score=3.0,
                   detector="straggler", action="observe")  # fmt: skip


def test_an_unwritable_finding_is_dropped_and_the_rest_is_stored(tmp_path):
    db = ServeDb(str(tmp_path / "w.duckdb"))
    stats = ServeStats()
    writer = ServeWriter(db, None, None, group="g", stats=stats)
    try:
        # 2**64 - 1 does not fit DuckDB's BIGINT: this once killed serve's writer thread
        writer.submit(WriteJob(findings=[_finding(3), _finding(2**64 - 1, (2,)), _finding(5, (3,))],
                               checkpoints=[("topic", 0, 42, '{"at": 42}')],
                               commit={"tp": 42}))  # fmt: skip
        writer.drain()
        with db.session() as s:
            assert s.tables.load_checkpoint("g", "topic", 0) == (42, '{"at": 42}')
            assert sorted(f["first_step"] for f in s.store.list_findings()) == [3, 5]
        assert writer.take_commits() == [{"tp": 42}] and stats.deadletters == 1
    finally:
        writer.close()
        db.close()


def test_a_checkpoint_orjson_cannot_write_is_still_written_and_read_back():
    state = {"a": 2**70, "b": float("nan"), "c": [1, 2]}
    text = dump_state(state)
    back = parse_json(text)
    assert back["a"] == 2**70 and math.isnan(back["b"])


def test_an_unloadable_checkpoint_starts_the_partition_fresh():
    part = PartitionState(lambda: Engine())
    part.saved_state = '{"assembler": {"job": {"world": "many"}}}'
    assert part.engine.jobs == []  # fresh, not raising on every use


def test_a_gpu_sample_on_the_telemetry_topic_is_taken_not_a_crash():
    gpu = {"v": 1, "type": "gpu", "job": "j", "host": "h", "gpu": 0, "t": 1.0, "temp_c": 50.0}
    part = PartitionState(lambda: Engine(EngineConfig(assembler=AssemblerConfig(clock="wall"))))
    recs = [_step(), gpu]
    part.note_steps(recs, 0, 7, 1.0)  # KeyError: 'step' once
    part.note_steps([gpu], 0, 8, 1.0)
    assert part.open_steps == {("j", 2): 7}
    # on the gpu topic, the records that belong on telemetry are taken out
    good = [gpu, _step(), gpu]
    out = misrouted(good, 0)
    assert good == [gpu, gpu] and out[0][0] == 1 and "belongs on telemetry" in out[0][1]


def test_a_failing_tick_drops_the_step_not_the_service():
    class Broken(Engine):
        def tick(self, now=None):
            raise ValueError("boom")

    part = PartitionState(Broken)
    stats = ServeStats()
    assert tick_guarded(part, 1.0, stats) == [] and stats.engine_errors == 1


def test_the_demo_lane_validates_its_records():
    recs = make_records(job="demo", dp=2, tp=1, steps=2, ranks_per_host=1)
    bad: list = []
    batch = [recs[0], {**recs[1], "step": 2**64 - 1}, 5, {**recs[2], "world": 2**20}, recs[3]]
    good = _checked(json.loads(json.dumps(batch)), 10, bad)
    assert [r["rank"] for r in good] == [0, 1]
    assert [(b.line, "64-bit" in b.reason or "world" in b.reason or "object" in b.reason)
            for b in bad] == [(12, True), (13, True), (14, True)]  # fmt: skip


class _Msg:
    def __init__(self, offset, value):
        self.offset, self.value = offset, value


class _BuggyEngine(Engine):
    """An engine with a bug on one record shape (what a future detector bug looks like)."""

    def feed(self, records, now=None):
        if any(r.get("tokens") == 13 for r in records):
            raise ZeroDivisionError("a bug")
        return super().feed(records, now)


def test_a_message_the_engine_fails_on_is_retried_alone_then_dead_lettered():
    from rankscope.pipeline.bus.kafka import encode_records
    from rankscope.pipeline.serve.guard import feed_apart

    recs = make_records(job="bug", dp=4, tp=1, steps=6, ranks_per_host=2)
    msgs = [_Msg(i, encode_records(recs[4 * i : 4 * i + 4])) for i in range(6)]
    msgs[3] = _Msg(3, encode_records([{**r, "tokens": 13} for r in recs[12:16]]))
    part = PartitionState(_BuggyEngine)
    dead = []
    found, fed = feed_apart(part, msgs, 1.0, gpu_topic=False,
                            dead=lambda m, why: dead.append((m.offset, why)))  # fmt: skip
    assert dead == [(3, "engine error: ZeroDivisionError: a bug")]
    assert fed == 20 and part.engine.stats("bug")["records"] == 20


def test_an_engine_whose_state_cannot_be_had_skips_the_checkpoint_not_the_service():
    from rankscope.pipeline.serve.guard import engine_output, engine_state

    class Broken(Engine):
        def state_dict(self):
            raise RuntimeError("detector state bug")

        def drain_scores(self, final=False):
            raise RuntimeError("scores bug")

    stats = ServeStats()
    part = PartitionState(Broken)
    assert engine_state(part, stats) is None and engine_output(part, stats) == ([], [])
    assert stats.engine_errors == 2
    ok = PartitionState(Engine)
    assert parse_json(engine_state(ok, stats)) == {"assembler": {}, "jobs": {}}

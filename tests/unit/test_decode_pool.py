"""``DecodePool``: a large batch decoded by worker processes gives, message for message,
the outcome the loop computes itself (columns, records, bad elements and the reasons of
unusable messages); a pool whose worker dies says so once and the loop decodes on."""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import orjson
from rankscope.pipeline.bus.decode_pool import POOL_MIN_BYTES, DecodePool, decode_outcome
from support.engine_synth import one_step_record


def _values() -> list:
    out = []
    for step in range(6):
        recs = [one_step_record(rank=r, step=step) for r in range(256)]
        for r in recs:
            r["world"] = 256
            r["host"] = "h" * 200  # ~1 KB a record: six messages pass the pool's threshold
        out.append(orjson.dumps(recs))
    mixed = [one_step_record(rank=0, step=9), {"v": 1, "type": "step"}, 7]
    out += [b"not json", None, orjson.dumps(mixed), b"{}"]
    assert sum(len(v) for v in out if v) >= POOL_MIN_BYTES
    return out


def _same(a, b) -> None:
    assert (a.error, a.bad, a.records) == (b.error, b.bad, b.records)
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert (a.batch.job, a.batch.n) == (b.batch.job, b.batch.n)
        np.testing.assert_array_equal(a.batch.step, b.batch.step)
        assert set(a.batch.chunk) == set(b.batch.chunk)
        for k, col in a.batch.chunk.items():
            np.testing.assert_array_equal(col, b.batch.chunk[k])


def _warm(pool: DecodePool, values) -> None:
    deadline = time.monotonic() + 60
    while not pool._started():
        assert time.monotonic() < deadline, "decode workers did not start"
        time.sleep(0.05)


def test_workers_decode_as_the_loop_does():
    values = _values()
    inline = [decode_outcome(v, 32) for v in values]
    pool = DecodePool(1)
    try:
        first = list(pool.outcomes(values, 32))  # starts the workers, decodes here meanwhile
        _warm(pool, values)
        pooled = list(pool.outcomes(values, 32))
    finally:
        pool.close()
    assert len(first) == len(pooled) == len(values)
    for a, b, c in zip(first, pooled, inline, strict=True):
        _same(a, c)
        _same(b, c)
    assert inline[0].batch is not None and inline[-4].error and inline[-2].bad


def test_start_brings_the_workers_up_before_any_batch():
    """``serve`` starts the pool with the service: the first large batch then goes to a
    worker that is already up (a cold start decoded seconds of a burst in the loop)."""
    pool = DecodePool(1)
    try:
        pool.start()
        assert pool._pool is not None and pool._warm is not None
        pool._warm.result(timeout=60)  # the worker answers without any outcomes() call
        assert pool._started()
        values = _values()
        got = list(pool.outcomes(values, 32))
        for a, b in zip(got, (decode_outcome(v, 32) for v in values), strict=True):
            _same(a, b)
        pool.start()  # a second start changes nothing
        assert pool._started()
    finally:
        pool.close()


def test_the_loop_decodes_the_parts_no_worker_took_while_it_would_wait():
    """Work stealing: while part 0 is not back, the parts still queued (cancellable) are
    decoded in the loop, from the last one back; a part a worker runs is left to it."""
    from concurrent.futures import Future

    values = _values()[:4]
    parts = [Future() for _ in values]
    parts[1].set_running_or_notify_cancel()  # taken by a worker: not the loop's
    pool = DecodePool(1)
    here: dict = {}
    pool._steal(parts, 0, here, values, 32)
    assert sorted(here) == [2, 3]
    assert parts[2].cancelled() and parts[3].cancelled() and not parts[1].cancelled()
    for j in (2, 3):
        _same(here[j][0], decode_outcome(values[j], 32))
    parts[0].set_result([decode_outcome(values[0], 32)])
    more: dict = {}
    pool._steal(parts, 0, more, values, 32)  # part 0 is back: nothing more to take
    assert more == {}


def test_a_dead_worker_is_said_once_and_the_loop_decodes(caplog):
    values = _values()
    pool = DecodePool(1)
    try:
        list(pool.outcomes(values, 32))
        _warm(pool, values)
        for pid in list(pool._pool._processes):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        with caplog.at_level(logging.WARNING, logger="rankscope.serve"):
            got = [list(pool.outcomes(values, 32)) for _ in range(3)]
    finally:
        pool.close()
    said = [r for r in caplog.records if "decode workers unusable" in r.getMessage()]
    assert len(said) == 1
    inline = [decode_outcome(v, 32) for v in values]
    for run in got:
        for a, b in zip(run, inline, strict=True):
            _same(a, b)

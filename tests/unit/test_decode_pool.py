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
from rankscope.pipeline.bus.decode_worker import claim_front
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
        assert len(pool._procs) == 1
        _warm(pool, None)  # the worker answers without any outcomes() call
        assert pool._ready == {0}
        values = _values()
        got = list(pool.outcomes(values, 32))
        for a, b in zip(got, (decode_outcome(v, 32) for v in values), strict=True):
            _same(a, b)
        pool.start()  # a second start changes nothing
        assert pool._started()
    finally:
        pool.close()


def test_the_loop_takes_parts_from_the_back_while_a_worker_holds_the_next(caplog):
    """Work stealing: while part 0 is a worker's (here: a worker stopped after taking it),
    the loop decodes the parts no one took, from the last one back; a worker that sends
    nothing for ``stall_s`` is said once and its part is decoded in the loop."""
    values = _values()
    pool = DecodePool(1, stall_s=1.0)
    order: list[int] = []
    part = pool._part
    pool._part = lambda v, k, m: (order.append(k), part(v, k, m))[1]
    pid = None
    try:
        _warm(pool, values)
        pid = pool._procs[0].proc.pid
        os.kill(pid, signal.SIGSTOP)
        gen = pool.outcomes(values, 32)  # the batch is posted; no worker runs
        assert claim_front(pool._claim, pool._batch) == 0  # as a worker would take part 0
        with caplog.at_level(logging.WARNING, logger="rankscope.serve"):
            got = list(gen)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)  # the pool, closed when it gave up, terminated it
        pool.close()
    assert order == list(range(len(values) - 1, 0, -1)) + [0]
    for a, b in zip(got, (decode_outcome(v, 32) for v in values), strict=True):
        _same(a, b)
    said = [r for r in caplog.records if "decode workers unusable" in r.getMessage()]
    assert len(said) == 1 and "no decoded part came back" in said[0].getMessage()


def test_a_batch_left_half_read_does_not_mix_with_the_next():
    """A caller that stops reading a batch (an engine error) leaves parts with the
    workers; the next batch waits for them and gets only its own outcomes."""
    values = _values()
    pool = DecodePool(1)
    try:
        _warm(pool, values)
        gen = pool.outcomes(values, 32)
        next(gen)
        del gen
        other = values[2:] + values[:2]
        got = list(pool.outcomes(other, 32))
    finally:
        pool.close()
    for a, b in zip(got, (decode_outcome(v, 32) for v in other), strict=True):
        _same(a, b)


def test_a_dead_worker_is_said_once_and_the_loop_decodes(caplog):
    values = _values()
    pool = DecodePool(1)
    try:
        list(pool.outcomes(values, 32))
        _warm(pool, values)
        for w in pool._procs:
            os.kill(w.proc.pid, signal.SIGKILL)
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


def test_no_room_for_the_segment_is_said_once_and_the_loop_decodes(caplog, monkeypatch):
    """A full /dev/shm: the reservation fails with the reason (writing into a sparse
    segment would have killed the process with SIGBUS) and the loop decodes."""
    import errno

    import rankscope.pipeline.bus.decode_pool as dp

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    values = _values()
    pool = DecodePool(1)
    try:
        _warm(pool, values)
        monkeypatch.setattr(dp.os, "posix_fallocate", full)
        with caplog.at_level(logging.WARNING, logger="rankscope.serve"):
            got = [list(pool.outcomes(values, 32)) for _ in range(2)]
    finally:
        pool.close()
    said = [r.getMessage() for r in caplog.records if "decode workers unusable" in r.getMessage()]
    assert len(said) == 1 and "cannot reserve" in said[0] and "No space left" in said[0]
    for run in got:
        for a, b in zip(run, (decode_outcome(v, 32) for v in values), strict=True):
            _same(a, b)
    assert not pool._procs  # the workers were stopped

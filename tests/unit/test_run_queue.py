"""cpu_wait_s: the training thread's wait for a CPU, read from Linux's schedstat.

A real contention: this thread and a spinning process pinned to one core.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import time

import pytest
import torch
from rankscope.collectors import RankCollector
from rankscope.collectors.rank.run_queue import RunQueueWait
from rankscope.collectors.rank.step_record import build_step_record
from rankscope.collectors.schema.records import validate_record
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel

linux = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                           reason="needs Linux schedstat")  # fmt: skip


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _SharedCore:
    """This process and a spinning one pinned to the same core while inside."""

    def __enter__(self):
        self.old = os.sched_getaffinity(0)
        core = min(self.old)
        self.hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.hog.pid, {core})
        os.sched_setaffinity(0, {core})
        return self

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.old)
        self.hog.kill()
        self.hog.wait()


@linux
def test_wait_grows_only_while_a_core_is_shared():
    rq = RunQueueWait()
    a = rq.read()
    _spin(0.2)  # alone (as alone as this host allows)
    b = rq.read()
    with _SharedCore():
        _spin(0.4)
        c = rq.read()
    rq.close()
    assert 0 <= a <= b <= c
    assert c - b > 0.1, (a, b, c)  # about half of the 0.4 s went to the hog
    assert c - b > 2 * (b - a), (a, b, c)


def test_unreadable_says_so_once_and_reads_none(caplog):
    rq = RunQueueWait("/nonexistent/schedstat")
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        assert rq.read() is None
        assert rq.read() is None
    said = [r for r in caplog.records if "cpu_wait_s not collected" in r.getMessage()]
    assert len(said) == 1


@linux
def test_step_records_carry_the_wait_a_shared_core_adds():
    q: queue.Queue = queue.Queue()
    register_channel("units-runq", q)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="runq", sink="embedded://units-runq",
                              rank=0, world=1, host="h0")  # fmt: skip

    def step(shared: bool) -> None:
        loss = model(torch.randn(4, 8)).sum()
        rc.loss(loss)
        loss.backward()
        if shared:
            with _SharedCore():
                _spin(0.3)
        else:
            _spin(0.1)
        opt.step()
        opt.zero_grad()

    for i in range(6):
        step(shared=i >= 3)
    rc.close()
    unregister_channel("units-runq")
    steps = [r for r in map(validate_record, iter_channel(q)) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(6))
    for r in steps:
        assert 0 <= r["cpu_wait_s"] <= r["step_s"]
    alone = max(r["cpu_wait_s"] for r in steps[:3])
    assert min(r["cpu_wait_s"] for r in steps[3:]) > max(0.08, 2 * alone), steps


class _Timing:
    """A device timing whose events resolved to (compute_s, comm_s), or not yet."""

    def __init__(self, device):
        self.device = device

    def resolve(self, events):
        return self.device


def _pending(device):
    p = {"step": 3, "t": 1.0, "step_s": 0.3, "data_s": 0.0, "comm_s": 0.1, "compute_s": 0.2,
         "loss": None, "lr": None, "local": [], "reduced": [], "nonfinite": [], "digest": None,
         "collectives": [], "tokens": None, "cpu_wait_s": 0.05}  # fmt: skip
    if device is not False:
        p["device"] = (_Timing(device), object())
    return p


def test_the_wait_goes_out_only_beside_cpu_times():
    base = {"job": "j", "rank": 0, "world": 1, "host": "h0"}
    cpu = build_step_record(base, _pending(False))
    assert cpu["cpu_wait_s"] == 0.05 and cpu["compute_s"] == 0.2
    late = build_step_record(base, _pending(None))  # events not resolved: CPU times kept
    assert late["cpu_wait_s"] == 0.05 and late["compute_s"] == 0.2
    gpu = build_step_record(base, _pending((0.15, 0.12)))
    assert "cpu_wait_s" not in gpu and gpu["compute_s"] == 0.15

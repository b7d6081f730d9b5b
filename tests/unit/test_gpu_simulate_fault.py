"""The simulator's ``gpu`` fault: scripted NVML under the real collector, in one process."""

from __future__ import annotations

import time

import pytest
import torch
from rankscope.pipeline.simulate.device import DeviceClock
from rankscope.pipeline.simulate.faults import FaultContext, fault_class
from rankscope.pipeline.simulate.spec import SpecError, parse_fault
from rankscope.pipeline.traces.files import read_trace


def run_fault(tmp_path, text, rank=0, steps=12, step_s=0.03):
    from rankscope.collectors import RankCollector

    spec = parse_fault(text)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    ctx = FaultContext(rank=rank, world=2, host="node00", steps=steps, seed=3, model=model,
                       optimizer=opt, report=reports.append)
    ctx.extra["device"] = DeviceClock(model, us_per_token=1000.0, step_fn=lambda: ctx.step)
    fault = fault_class("gpu")(spec)
    fault.install(ctx)
    rc = RankCollector.attach(model, opt, job="gf", sink=f"file://{tmp_path}", rank=rank,
                              world=2, host="node00")
    ctx.extra["collector"] = rc
    try:
        for step in range(steps):
            ctx.step = step
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            time.sleep(step_s)
        time.sleep(0.15)
        fault.close(ctx)
    finally:
        rc.close()
    recs = read_trace(tmp_path).records
    return ([r for r in recs if r["type"] == "gpu"], [r for r in recs if r["type"] == "step"],
            reports)


def test_a_rank_samples_its_own_index_on_its_emulated_host():
    from rankscope.pipeline.simulate.faults.gpu import _local_index
    from rankscope.pipeline.simulate.spec import host_of

    for world, per_host in ((8, 4), (8, 2), (8, 8), (16, 8), (4, 1)):
        for rank in range(world):
            assert _local_index(rank, world, host_of(rank, per_host)) == rank % per_host


def test_spec_checks():
    assert parse_fault("gpu:rank=1,from=5,mode=ecc").params == {"mode": "ecc"}
    for bad, needle in (("gpu:rank=1,mode=fire", "mode should be one of"),
                        ("gpu:rank=1,factor=0.5", "factor"),
                        ("gpu:rank=1,xid=-3", "xid"),
                        ("gpu:rank=1,interval_s=100", "interval_s")):
        with pytest.raises(SpecError, match=needle):
            parse_fault(bad)


def test_thermal_mode_throttles_the_gpu_and_is_reported(tmp_path):
    gpu, steps, reports = run_fault(
        tmp_path, "gpu:rank=0,from=5,mode=thermal,factor=1.5,interval_s=0.05")
    assert len(gpu) >= 5 and {r["rank"] for r in gpu} == {0}
    early = [r for r in gpu if r["t"] < steps[3]["t"]]
    late = [r for r in gpu if r["t"] > steps[7]["t"]]
    assert early and late
    assert all(r["sm_clock_mhz"] >= 1950 and "sw_thermal" not in r.get("clock_events", [])
               for r in early)
    assert all(r["sm_clock_mhz"] <= 1335 and r["clock_events"] == ["sw_thermal"] for r in late)
    assert all(83 <= r["temp_c"] <= 85 for r in late)
    assert reports and reports[0]["mode"] == "thermal" and reports[0]["magnitude"] == 1.5
    before = sorted(r["compute_s"] for r in steps[1:5])[2]
    after = sorted(r["compute_s"] for r in steps[6:])[3]
    assert after > 1.25 * before, (before, after)  # the emulated device time stretched


def test_xid_mode_delivers_one_event(tmp_path):
    gpu, _, reports = run_fault(tmp_path, "gpu:rank=0,from=4,mode=xid,xid=48,interval_s=0.05")
    assert [r["xid"] for r in gpu if r.get("xid")] == [[48]]
    assert reports[0]["step"] >= 4


def test_ecc_mode_raises_the_uncorrected_counter_on_the_faulty_rank_only(tmp_path):
    gpu, _, _ = run_fault(tmp_path / "a", "gpu:rank=0,from=4,mode=ecc,interval_s=0.05")
    assert gpu[0]["ecc_dbe"] == 0 and gpu[-1]["ecc_dbe"] == 1
    gpu, _, reports = run_fault(tmp_path / "b", "gpu:rank=1,from=4,mode=ecc,interval_s=0.05")
    assert {r["ecc_dbe"] for r in gpu} == {0} and reports == []

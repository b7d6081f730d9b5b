"""GPU-to-rank mapping: in-process attach next to the rank collector, and the sidecar CLI."""

from __future__ import annotations

import json
import time

import pytest
import torch
from rankscope.collectors.gpu.attach import attach_for_rank, local_cuda_index, nvml_selector
from rankscope.collectors.gpu.collector import GpuCollector, GpuCollectorConfig
from rankscope.pipeline.cli import main
from rankscope.pipeline.cli.collect_gpu import load_rank_map
from rankscope.pipeline.traces.files import read_trace
from support.fake_nvml import FakeNvml, install
from support.sinks import NullSink

FAST = GpuCollectorConfig(interval_s=0.05, counters_interval_s=0.05, event_wait_s=0.02,
                          flush_interval_s=0.05)


def test_cuda_index_maps_to_nvml_through_cuda_visible_devices():
    assert local_cuda_index({"LOCAL_RANK": "3"}) == 3
    assert local_cuda_index({}) == 0
    assert nvml_selector(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert nvml_selector(0, {"CUDA_VISIBLE_DEVICES": "GPU-scripted-0005"}) == "GPU-scripted-0005"
    assert nvml_selector(2, {}) == 2


def test_uuid_selector_resolves_to_the_nvml_index():
    coll = GpuCollector("j", sink=NullSink(), devices=["GPU-scripted-0006"], rank=11,
                        nvml=FakeNvml(8))
    assert coll.open() and coll.devices == [6]
    (rec,) = coll.collect()
    assert (rec["gpu"], rec["rank"]) == (6, 11)
    coll.close()


def test_attach_for_rank_samples_its_own_gpu_through_the_rank_collector(tmp_path):
    from rankscope.collectors import RankCollector

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rc = RankCollector.attach(model, opt, job="att", sink=f"file://{tmp_path}", rank=5, world=8,
                              host="node01")
    fake = FakeNvml(8)
    env = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    gc = attach_for_rank(rc, config=FAST, nvml=fake, env=env)
    try:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            rc.loss(loss.item())
        deadline = time.monotonic() + 5
        while gc.stats.records < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        gc.close()
        rc.close()
    gpu = [r for r in read_trace(tmp_path).records if r["type"] == "gpu"]
    assert len(gpu) >= 2
    assert {(r["gpu"], r["rank"], r["host"], r["job"]) for r in gpu} == {(3, 5, "node01", "att")}
    steps = [r for r in read_trace(tmp_path).records if r["type"] == "step"]
    assert steps  # same file, same sender


def test_attach_without_driver_never_raises():
    class RC:
        job = "j"

        class identity:  # noqa: N801 - stands in for the rank collector's Identity
            host, rank = "h", 0

        sender = None
        _sender = NullSink()

    gc = attach_for_rank(RC(), nvml=FakeNvml(2, driver=False), env={})
    assert gc.ready.wait(5) and gc.idle
    gc.close()


# ---- rank map files ------------------------------------------------------------------


@pytest.mark.parametrize("content,expected", [
    ({"0": 8, "1": 9}, {0: 8, 1: 9}),
    ([16, 17, 18], {0: 16, 1: 17, 2: 18}),
    ({"nodeA": {"0": 1}, "nodeB": [4, 5]}, {0: 4, 1: 5}),
])
def test_rank_map_forms(tmp_path, content, expected):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(content))
    assert load_rank_map(path, "nodeB") == expected


@pytest.mark.parametrize("text,needle", [
    ("{not json", "is not JSON"),
    ('{"0": -1}', "should be an int"),
    ('{"x": {"0": 1}}', "no entry for host"),
    ('{"0": "three"}', "should be an int"),
    ('"hello"', "should be an object or a list"),
])
def test_rank_map_errors_say_what_is_wrong(tmp_path, text, needle, capsys):
    path = tmp_path / "map.json"
    path.write_text(text)
    code = main(["collect-gpu", "--job", "j", "--sink", f"file://{tmp_path}/o",
                 "--rank-map", str(path), "--host", "nodeB"])
    assert code == 1 and needle in capsys.readouterr().err


# ---- the sidecar -------------------------------------------------------------------------


def test_sidecar_streams_mapped_records_to_a_file_sink(tmp_path, monkeypatch, capsys):
    fake = install(monkeypatch, FakeNvml(4))
    fake.gpus[2].clock_event_mask = 0x40
    (tmp_path / "map.json").write_text(json.dumps({"node07": [24, 25, 26, 27]}))
    out = tmp_path / "trace"
    code = main(["collect-gpu", "--job", "side", "--sink", f"file://{out}", "--interval-s",
                 "0.05", "--rank-map", str(tmp_path / "map.json"), "--host", "node07",
                 "--duration-s", "0.4"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "sampling GPU(s) [0, 1, 2, 3] of host node07" in err
    recs = read_trace(out).records
    assert len(recs) >= 8
    assert {(r["gpu"], r["rank"]) for r in recs} == {(0, 24), (1, 25), (2, 26), (3, 27)}
    assert all(r["clock_events"] == ["hw_thermal"] for r in recs if r["gpu"] == 2)


def test_sidecar_without_driver_says_so_and_exits_1(tmp_path, monkeypatch, capsys):
    install(monkeypatch, FakeNvml(2, driver=False))
    code = main(["collect-gpu", "--job", "j", "--sink", f"file://{tmp_path}", "--duration-s", "1"])
    assert code == 1
    assert "no usable NVIDIA driver" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["collect-gpu", "--sink", "file:///tmp/x"], "--job"),
    (["collect-gpu", "--job", "j", "--sink", "x", "--interval-s", "0"], "must be > 0"),
    (["collect-gpu", "--job", "j", "--sink", "x", "--devices", "a,b"], "indices"),
])
def test_sidecar_misuse_exits_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_sidecar_bad_sink_is_a_clear_error(capsys, monkeypatch):
    install(monkeypatch, FakeNvml(1))
    assert main(["collect-gpu", "--job", "j", "--sink", "nope://x", "--duration-s", "1"]) == 1
    assert "unknown sink URL scheme" in capsys.readouterr().err

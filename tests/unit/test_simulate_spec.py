"""Fault specs, topology, config checks and CLI misuse of ``rankscope simulate`` (no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from rankscope.pipeline.cli import main
from rankscope.pipeline.simulate import (
    SimConfig,
    SpecError,
    parse_fault,
    parse_topology,
    rank_coords,
)
from rankscope.pipeline.simulate.faults import fault_kinds, flip_bit, parse_bit
from rankscope.pipeline.simulate.labels import build_labels, build_meta
from rankscope.pipeline.simulate.spec import host_of


def test_parse_straggler_spec():
    spec = parse_fault("straggler:rank=3,from=120,factor=1.6")
    assert (spec.kind, spec.rank, spec.from_step, spec.until_step) == ("straggler", 3, 120, None)
    assert spec.params == {"factor": 1.6}
    assert spec.text == "straggler:rank=3,from=120,factor=1.6"
    spec = parse_fault(" straggler:rank=0, from=5, until=9, factor=1.25, phase=backward ")
    assert spec.params == {"factor": 1.25, "phase": "backward"}
    assert spec.active(0, 5) and spec.active(0, 9)
    assert not spec.active(0, 4) and not spec.active(0, 10) and not spec.active(1, 6)


def test_every_kind_is_registered():
    assert set(fault_kinds()) >= {
        "none", "straggler", "network", "sdc-grad", "sdc-param", "sdc-reduce",
        "nonfinite", "hang", "crash",
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty fault spec"),
        ("slow:rank=1", "unknown kind 'slow'"),
        ("straggler:from=3", "rank=N is required"),
        ("straggler:rank=x", "rank='x' should be an integer"),
        ("straggler:rank=-1", "rank=-1 should be >= 0"),
        ("straggler:rank=1,fator=2", "unknown parameter 'fator'"),
        ("straggler:rank=1,factor=0.5", "factor should be within 1..100"),
        ("straggler:rank=1,phase=sideways", "phase should be all, forward or backward"),
        ("straggler:rank=1,rank=2", "'rank' given twice"),
        ("straggler:rank=1,from=9,until=3", "until=3 is before from=9"),
        ("straggler:rank", "should be key=value"),
        ("network:rank=1", "delay_s= is required"),
        ("network:rank=1,delay_s=0", "delay_s should be within"),
        ("sdc-grad:rank=1,bit=40", "bit index should be within 0..31"),
        ("sdc-grad:rank=1,bit=top", "should be exponent, mantissa, sign"),
        ("nonfinite:rank=1,value=zero", "value should be nan, inf or -inf"),
        ("crash:rank=1,code=0", "code should be within 1..125"),
        ("none:rank=1", "takes no parameters"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(SpecError, match=None) as info:
        parse_fault(text)
    assert message in str(info.value)


def test_topology_sizes_and_coordinates():
    assert parse_topology(None, 8) == {"dp": 8, "tp": 1, "pp": 1}
    assert parse_topology("tp=2,pp=2", 8) == {"dp": 2, "tp": 2, "pp": 2}
    assert parse_topology({"dp": 4, "tp": 2}, 8) == {"dp": 4, "tp": 2, "pp": 1}
    topo = {"dp": 2, "tp": 2, "pp": 2}
    coords = [rank_coords(r, topo) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1, 0, 1, 0, 1, 0, 1]  # tp fastest
    assert [c["dp"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c["pp"] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({tuple(c.values()) for c in coords}) == 8
    assert [host_of(r, 4) for r in (0, 3, 4, 7)] == ["node00", "node00", "node01", "node01"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("dp=3,tp=2", "dp*tp*pp = 6, but there are 8 ranks"),
        ("tp=3", "does not divide 8 ranks"),
        ("xp=2", "unknown axis 'xp'"),
        ("tp=two", "should be an integer"),
        ("tp", "should be axis=size"),
        ("tp=0", "should be >= 1"),
    ],
)
def test_bad_topologies(text, message):
    with pytest.raises(SpecError) as info:
        parse_topology(text, 8)
    assert message in str(info.value)


def test_config_resolves_steps_and_checks_against_the_run(tmp_path):
    cfg = SimConfig(
        ranks=4, steps=20, out_dir=str(tmp_path), ranks_per_host=2,
        faults=["straggler:rank=1,from=5,factor=2", "sdc-grad:rank=2", "sdc-param:rank=3,from=7"],
    )
    straggler, sdc_grad, sdc_param = cfg.faults
    assert (straggler.from_step, straggler.until_step) == (5, None)  # to the end
    assert (sdc_grad.from_step, sdc_grad.until_step) == (10, 10)  # default: mid-run, one step
    assert (sdc_param.from_step, sdc_param.until_step) == (7, 7)
    assert cfg.job == "sim-sdc-grad-sdc-param-straggler-s0"
    labels = build_labels(cfg, [{"fault": sdc_grad.text, "magnitude": 1e30}])
    assert [lab["kind"] for lab in labels] == ["straggler", "sdc", "sdc"]
    assert labels[0] == {
        "kind": "straggler", "ranks": [1], "hosts": ["node00"], "step": 5, "until": None,
        "note": "straggler:rank=1,from=5,factor=2 (fault kind straggler)", "magnitude": 2.0,
    }
    assert labels[1]["hosts"] == ["node01"]
    assert (labels[1]["until"], labels[1]["magnitude"]) == (10, 1e30)
    assert labels[2]["until"] is None  # a diverged replica stays diverged
    meta = build_meta(cfg, {"ended": "completed"})
    assert meta["world"] == 4 and meta["ranks_per_host"] == 2
    assert meta["hosts"]["3"] == "node01" and meta["ended"] == "completed"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ranks": 0, "steps": 5}, "ranks should be >= 1"),
        ({"ranks": 2, "steps": 0}, "steps should be >= 1"),
        ({"ranks": 4, "steps": 5, "ranks_per_host": 3}, "does not divide 4 ranks"),
        ({"ranks": 2, "steps": 5, "faults": ["crash:rank=2"]}, "rank=2 but there are 2 ranks"),
        ({"ranks": 2, "steps": 5, "faults": ["hang:rank=1,from=5"]}, "the run has 5 steps"),
        ({"ranks": 2, "steps": 5, "stall_s": 0}, "stall_s should be > 0"),
        ({"ranks": 2, "steps": 5, "topology": "tp=4"}, "does not divide 2 ranks"),
        ({"ranks": 2, "steps": 5, "sink": "bogus://x"}, "unknown scheme 'bogus'"),
    ],
)
def test_config_checks(tmp_path, kwargs, message):
    with pytest.raises(SpecError) as info:
        SimConfig(out_dir=str(tmp_path), **kwargs)
    assert message in str(info.value)


def test_config_needs_a_destination():
    with pytest.raises(SpecError, match="out_dir is required"):
        SimConfig(ranks=2, steps=3)


def test_bit_flips():
    assert parse_bit("exponent") == 30 and parse_bit("mantissa") == 22 and parse_bit("7") == 7
    t = torch.full((4,), 1e-3)
    before, after = flip_bit(t, 2, 30)
    assert before == pytest.approx(1e-3) and after > 1e30 and float(t[2]) == after
    before, after = flip_bit(t, 1, 22)
    assert 1.2 < after / before < 1.6 or 0.6 < after / before < 0.8
    flip_bit(t, 1, 22)
    assert float(t[1]) == pytest.approx(1e-3)  # flipping twice restores
    assert not math.isnan(float(t.sum()))


def test_cli_misuse_exits_nonzero_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--ranks", "2", "--steps", "3", "--out", str(tmp_path),
              "--fault", "straggler:rank=1,fator=2"])
    assert info.value.code == 2
    assert "unknown parameter 'fator'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--ranks", "0", "--steps", "3", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "should be >= 1" in capsys.readouterr().err
    code = main(["simulate", "--ranks", "2", "--steps", "3", "--out", str(tmp_path),
                 "--fault", "crash:rank=5"])
    assert code == 1
    assert "rank=5 but there are 2 ranks" in capsys.readouterr().err
    code = main(["simulate", "--ranks", "4", "--steps", "3", "--out", str(tmp_path),
                 "--topology", "dp=3"])
    assert code == 1
    assert "dp*tp*pp = 3, but there are 4 ranks" in capsys.readouterr().err


def test_device_clock_stretches_the_optimizer_step_of_a_whole_step_straggler():
    """phase=all slows the optimizer step too (on a GPU it is device work); phase=backward
    does not. Timing as lower bounds only: a sleep is never shorter than asked."""
    import time

    from rankscope.pipeline.simulate.device import DeviceClock
    from rankscope.pipeline.simulate.faults import fault_class

    for phase, stretched in (("all", True), ("backward", False)):
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = {"n": 0}
        clock = DeviceClock(model, us_per_token=0.0, step_fn=lambda s=step: s["n"])
        clock.watch_optimizer(opt)
        opt.register_step_pre_hook(lambda *a: time.sleep(0.02))  # "optimizer work"
        spec = parse_fault(f"straggler:rank=0,from=1,factor=3,phase={phase}")
        fault = fault_class("straggler")(spec)

        class Ctx:
            rank = 0
            extra = {"device": clock}

        fault.install(Ctx)
        model(torch.ones(2, 4)).sum().backward()
        t0 = time.perf_counter()
        opt.step()  # step 0: before the fault
        plain = time.perf_counter() - t0
        step["n"] = 1
        t0 = time.perf_counter()
        opt.step()
        slow = time.perf_counter() - t0
        assert plain >= 0.02 and clock.factor("backward") == 3.0
        assert clock.factor("optimizer") == (3.0 if stretched else 1.0)
        if stretched:
            assert slow >= 0.02 * 3  # the work, then (3 - 1) x the work more

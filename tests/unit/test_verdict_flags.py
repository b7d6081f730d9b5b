"""``--crash-within`` / ``--hang-within`` on ``serve`` and ``demo``: what they set, and misuse."""

from __future__ import annotations

from argparse import Namespace

import pytest
from rankscope.pipeline.cli.main import main
from rankscope.pipeline.cli.verdict_flags import verdict_configs
from rankscope.pipeline.engine.assemble import AssemblerConfig
from rankscope.pipeline.engine.engine import Engine, EngineConfig


def test_the_flags_set_the_hang_monitor_of_the_engine():
    configs = verdict_configs(Namespace(crash_within=3.0, hang_within=20.0))
    eng = Engine(EngineConfig(assembler=AssemblerConfig(clock="event")), detector_configs=configs)
    cfg = eng.beat_monitor_factory("j").cfg
    assert (cfg.crash_s, cfg.crash_margin_s, cfg.stall_min_s) == (3.0, 1.5, 20.0)
    assert verdict_configs(Namespace(crash_within=None, hang_within=None)) == {}
    default = Engine(EngineConfig()).beat_monitor_factory("j").cfg
    assert (default.crash_s, default.stall_min_s) == (5.0, 10.0)


@pytest.mark.parametrize("flag, value", [("--crash-within", "0"), ("--hang-within", "-2")])
def test_misuse_says_what_is_wrong_and_exits_non_zero(flag, value, tmp_path, capsys):
    serve = ["serve", "--bus", "kafka://127.0.0.1:1", "--db", str(tmp_path / "f.duckdb"),
             "--no-control", flag, value]  # fmt: skip
    assert main(serve) == 1
    assert f"{flag} must be > 0" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "demo"), flag, value]) == 1
    assert f"{flag} must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # nothing ran

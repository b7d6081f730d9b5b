"""``scripts/live`` (what ``make live`` runs) against the shared broker: up, a finding, down.

The script takes an existing broker (``--bootstrap``) and a recorded trace
(``--trace``) instead of starting its own broker and simulating, so this runs
in seconds; ``make live`` itself is the same script with those two defaults.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

from support.kafka import bootstrap
from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "live"
TRACE = ROOT / "sample_traces" / "straggler-1.6x"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _live(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def _pids(live: Path) -> list[int]:
    return [int(p.read_text().split()[0]) for p in live.glob("*.pid")]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_live_stack_up_finds_the_straggler_and_down_stops_only_what_it_started(tmp_path):
    from rankscope.pipeline.bus.kafka import KafkaBus

    live = tmp_path / "live"
    tag = f"live{uuid.uuid4().hex[:8]}"
    port = _free_port()
    env = {**os.environ, "RANKSCOPE_LIVE_DIR": str(live), "RANKSCOPE_LIVE_PREFIX": tag,
           "RANKSCOPE_LIVE_GROUP": tag, "RANKSCOPE_LIVE_WAIT_S": "120",
           "RANKSCOPE_BIN": str(Path(sys.executable).parent / "rankscope")}  # fmt: skip
    boot = bootstrap()
    try:
        up = _live(env, "up", "--bootstrap", boot, "--trace", str(TRACE), "--port", str(port))
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"http://127.0.0.1:{port}/" in up.stdout
        # the straggler of the trace, on its rank and host, as replay finds it
        rows = [ln.split() for ln in up.stdout.splitlines() if ln.startswith("sample-straggler")]
        assert rows and rows[-1][1:4] == ["straggler", "5", "node01"], up.stdout
        secret = live / "control.secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert len(secret.read_text().strip()) >= 32
        assert stat.S_IMODE(live.stat().st_mode) == 0o700
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=10) as r:
            assert r.status == 200
        (metrics,) = [ln.split()[1] for ln in up.stdout.splitlines() if ln.strip().startswith(
            "metrics ")]  # fmt: skip
        with urllib.request.urlopen(metrics, timeout=10) as r:
            assert b"rankscope_" in r.read()  # serve's Prometheus endpoint, records counted
        status = _live(env, "status")
        assert status.returncode == 0 and "serve: running" in status.stdout
        assert "broker" not in status.stdout  # given a broker, the stack does not own it
        pids = _pids(live)
        assert len(pids) == 3  # serve, dashboard, and the feed (its pid file, ended or not)
    finally:
        down = _live(env, "down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert not list(live.glob("*.pid"))
    assert not [p for p in pids if _running(p)]
    assert _live(env, "status").returncode == 3
    host, _, bport = boot.rpartition(":")
    socket.create_connection((host, int(bport)), timeout=5).close()  # the shared broker runs on
    assert "stopped serve" in down.stderr and "kafka:" not in down.stderr
    KafkaBus(f"kafka://{boot}?topic_prefix={tag}").delete_topics()

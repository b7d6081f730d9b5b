"""Real multi-process simulate runs (gloo on CPU): the recorded trace and labels per fault family.

Each test runs a short real job through ``run_simulation`` (the ranks share
one fork server, so only the first run pays for importing torch there) and
then reads back what the rank collectors recorded.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
from rankscope.pipeline.cli import main
from rankscope.pipeline.simulate import SimConfig, run_simulation
from rankscope.pipeline.simulate.model import ModelConfig
from rankscope.pipeline.traces.files import read_trace

pytestmark = pytest.mark.multiproc


def _load(out_dir):
    trace = read_trace(out_dir)
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    steps: dict[int, dict[int, dict]] = defaultdict(dict)
    beats: dict[int, list[dict]] = defaultdict(list)
    for rec in trace.records:
        if rec["type"] == "step":
            steps[rec["step"]][rec["rank"]] = rec
        elif rec["type"] == "beat":
            beats[rec["rank"]].append(rec)
    for rank_beats in beats.values():
        rank_beats.sort(key=lambda b: b["t"])
    return trace, steps, beats


# Tests of mechanisms (injection, endings) run with less than the default device
# time: their steps are shorter and they do not judge timing noise.
FAST = ModelConfig(device_us_per_token=100.0)


def _median(steps, ranks, field, window):
    return {r: statistics.median(steps[s][r][field] for s in window) for r in ranks}


def test_corruption_faults_show_where_they_were_injected(tmp_path):
    cfg = SimConfig(
        ranks=4, steps=24, out_dir=str(tmp_path), ranks_per_host=2, topology="tp=2",
        faults=[
            "sdc-param:rank=2,from=8",
            "sdc-grad:rank=1,from=12",
            "nonfinite:rank=3,from=16",
            "sdc-reduce:rank=0,from=20",
        ],
        model=FAST,
    )
    result = run_simulation(cfg)
    assert result.ended == "completed" and result.ok, result.errors
    trace, steps, _ = _load(tmp_path)
    assert sorted(steps) == list(range(24))
    assert all(sorted(steps[s]) == [0, 1, 2, 3] for s in steps)
    # emulated topology and hosts: tp fastest, two ranks per host
    r3 = steps[0][3]
    assert (r3["host"], r3["dp"], r3["tp"], r3["pp"], r3["world"]) == ("node01", 1, 1, 0, 4)
    assert {rec["job"] for rec in trace.records} == {cfg.job}

    # before any fault: local norms differ (own data), reduced norms and digests agree
    for s in range(8):
        row = steps[s]
        assert len({round(row[r]["grad_norm"], 6) for r in row}) == 4
        assert len({row[r]["grad_norm_reduced"] for r in row}) == 1
        assert len({row[r]["param_digest"] for r in row}) == 1
    # sdc-param: rank 2's weights diverge at step 8 and stay diverged
    for s in range(8, 24):
        assert steps[s][2]["param_digest"] != steps[s][1]["param_digest"], s
    for s in range(8, 20):
        assert steps[s][0]["param_digest"] == steps[s][1]["param_digest"] == steps[s][3][
            "param_digest"
        ]
    # sdc-grad at step 12 on rank 1: only its local norm blows up (or overflows)
    huge = steps[12][1].get("grad_norm")
    assert huge is None or huge > 1e6
    assert all(steps[12][r]["grad_norm"] < 100 for r in (0, 2, 3))
    assert steps[13][1]["grad_norm"] < 100  # one step only
    # nonfinite at step 16 on rank 3: the NaN is born there
    assert [steps[16][r]["nonfinite"] for r in range(4)] == [0, 0, 0, 1]
    assert all(steps[17][r]["nonfinite"] == 0 for r in range(4))  # the step was skipped
    # sdc-reduce at step 20 on rank 0: its reduced gradient disagrees, then its weights
    assert steps[20][1]["grad_norm_reduced"] == steps[20][3]["grad_norm_reduced"]
    assert steps[20][0].get("grad_norm_reduced") != steps[20][1]["grad_norm_reduced"]
    assert steps[20][0]["param_digest"] != steps[20][1]["param_digest"]
    assert steps[23][1]["param_digest"] == steps[23][3]["param_digest"]

    labels = {lab["note"].split(" ")[0]: lab for lab in trace.labels}
    assert labels["sdc-param:rank=2,from=8"] | {"magnitude": 0} == {
        "kind": "sdc", "ranks": [2], "hosts": ["node01"], "step": 8, "until": None,
        "note": "sdc-param:rank=2,from=8 (fault kind sdc-param)", "magnitude": 0,
    }
    assert 0 < labels["sdc-param:rank=2,from=8"]["magnitude"] < 1  # a mantissa flip
    assert (labels["sdc-grad:rank=1,from=12"]["kind"], labels["sdc-grad:rank=1,from=12"]["until"]) \
        == ("sdc", 12)
    assert labels["nonfinite:rank=3,from=16"]["kind"] == "nonfinite"
    assert labels["sdc-reduce:rank=0,from=20"]["hosts"] == ["node00"]
    meta = trace.meta[0]
    assert meta["ended"] == "completed" and meta["world"] == 4
    assert meta["topology"] == {"dp": 2, "tp": 2, "pp": 1}
    assert sorted((i["kind"], i["rank"], i["step"]) for i in meta["injections"]) == [
        ("nonfinite", 3, 16), ("sdc-grad", 1, 12), ("sdc-param", 2, 8), ("sdc-reduce", 0, 20),
    ]


def test_straggler_then_slow_network(tmp_path):
    cfg = SimConfig(
        ranks=4, steps=30, out_dir=str(tmp_path), ranks_per_host=2,
        faults=[
            "straggler:rank=1,from=10,until=19,factor=4",
            "network:rank=3,from=20,delay_s=0.05",
        ],
        model=FAST,
    )
    result = run_simulation(cfg)
    assert result.ok, result.errors
    _, steps, _ = _load(tmp_path)
    ranks = [0, 1, 2, 3]
    compute = _median(steps, ranks, "compute_s", range(10, 20))
    peers = statistics.median(compute[r] for r in (0, 2, 3))
    assert max(compute, key=compute.get) == 1
    # Not the full factor: ranks share two CPU cores, so every compute_s also
    # holds time spent waiting for a core, which the slow rank does not stretch.
    assert compute[1] >= 1.5 * peers, compute
    # ... and the peers wait for it in the all-reduce, which the slow rank does not
    waits = _median(steps, ranks, "comm_s", range(10, 20))
    assert waits[1] < min(waits[r] for r in (0, 2, 3)), waits
    # the slow link: rank 3's reductions finish late, so it enters the next ones last
    comm = _median(steps, ranks, "comm_s", range(21, 30))
    assert comm[3] >= 0.05, comm
    def arrival(s, r):
        return steps[s][r]["collectives"][0]["t0"]

    late = {r: statistics.median(arrival(s, r) - min(arrival(s, q) for q in ranks)
                                 for s in range(21, 30)) for r in ranks}
    assert max(late, key=late.get) == 3 and late[3] >= 0.025, late
    labels = sorted(read_trace(tmp_path).labels, key=lambda lab: lab["step"])
    got = [(lab["kind"], lab["ranks"], lab["step"], lab["until"], lab["magnitude"])
           for lab in labels]
    assert got == [("straggler", [1], 10, 19, 4.0), ("network", [3], 20, None, 0.05)]


def test_hang_is_ended_after_beats_show_who_is_blocked(tmp_path):
    cfg = SimConfig(
        ranks=4, steps=20, out_dir=str(tmp_path), ranks_per_host=2,
        faults=["hang:rank=2,from=6"], beat_interval_s=0.25, stall_s=2.0, stop_grace_s=4.0,
        model=FAST,
    )
    result = run_simulation(cfg)
    assert (result.ended, result.ok) == ("hang", True)
    assert set(result.exit_codes.values()) == {75}  # every rank was stopped by the harness
    _, steps, beats = _load(tmp_path)
    assert max(steps) == 5 and sorted(steps[5]) == [0, 1, 2, 3]
    hung = [b for b in beats[2] if b["step"] == 6]
    # a beat may come between the step's start (phase "data") and its first forward
    # (CI: 13 beats at step 6, not all "forward"); once in forward the rank stays there
    first = next(i for i, b in enumerate(hung) if b["phase"] == "forward")
    assert first <= 2, [b["phase"] for b in hung]
    assert len(hung[first:]) >= 4 and all(b["phase"] == "forward" for b in hung[first:])
    for r in (0, 1, 3):
        waiting = [b for b in beats[r] if b["step"] == 6]
        assert len(waiting) >= 4
        assert waiting[-1]["phase"] == "collective" and waiting[-1]["coll_done"] is False
    labels = read_trace(tmp_path).labels
    got = [(lab["kind"], lab["ranks"], lab["hosts"], lab["step"], lab["until"]) for lab in labels]
    assert got == [("hang", [2], ["node01"], 6, None)]


def test_crash_ends_cleanly_with_peers_failing(tmp_path):
    cfg = SimConfig(
        ranks=3, steps=40, out_dir=str(tmp_path), faults=["crash:rank=1,from=25,code=13"],
        beat_interval_s=0.1, model=FAST,
    )
    result = run_simulation(cfg)
    assert (result.ended, result.ok) == ("crash", True)
    assert result.exit_codes[1] == 13
    assert all(result.exit_codes[r] not in (0, None) for r in (0, 2))
    _, steps, beats = _load(tmp_path)
    assert max(steps) <= 24
    assert all(beats[r] for r in range(3))  # every rank beat, the crashed one included
    assert result.meta["ended"] == "crash"
    assert read_trace(tmp_path).labels[0]["kind"] == "crash"


def test_embedded_sink_streams_records_to_the_parent(tmp_path):
    seen: list[dict] = []
    cfg = SimConfig(ranks=2, steps=10, sink="embedded://sim-test", out_dir=str(tmp_path / "o"),
                    beat_interval_s=0.1)
    result = run_simulation(cfg, on_record=seen.append)
    assert result.ok
    step_recs = [r for r in seen if r["type"] == "step"]
    assert sorted((r["rank"], r["step"]) for r in step_recs) == [
        (r, s) for r in range(2) for s in range(10)
    ]
    assert result.records_streamed == len(seen)
    assert not list((tmp_path / "o").glob("*.jsonl.gz"))
    assert (tmp_path / "o" / "meta.json").is_file()


def test_cli_records_a_gzip_trace(tmp_path, capsys):
    code = main(["simulate", "--ranks", "2", "--steps", "6", "--out", str(tmp_path),
                 "--fault", "straggler:rank=1,from=2,factor=1.5", "--gzip", "--seed", "3"])
    assert code == 0
    out = capsys.readouterr().out
    assert "ended 'completed'" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "labels.jsonl" in files and "meta.json" in files
    assert sum(name.endswith(".jsonl.gz") for name in files) == 2
    _, steps, _ = _load(tmp_path)
    assert len(steps) == 6 and all(len(row) == 2 for row in steps.values())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return not any(line.startswith("State:") and "Z" in line for line in fh)
    except FileNotFoundError:
        return False


def test_ranks_do_not_outlive_a_killed_harness(tmp_path):
    import re
    import subprocess
    import sys
    import time

    script = (
        "from pipeline.simulate import SimConfig, run_simulation\n"
        f"run_simulation(SimConfig(ranks=2, steps=100000, out_dir={str(tmp_path)!r}))\n"
    )
    harness = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        pids: set[int] = set()
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = {int(m.group(1)) for f in tmp_path.glob("rank*.jsonl")
                    if (m := re.search(r"-p(\d+)-", f.name))}
        assert len(pids) == 2, "the ranks never started recording"
        assert all(_alive(p) for p in pids)
    finally:
        harness.kill()
        harness.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)

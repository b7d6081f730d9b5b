"""The first screen's sentences, built from the evidence detectors really store.

The store is the replayed sample traces (real multi-process runs with
injected faults); each kind's sentence is checked against the numbers in
that finding's evidence, read back with plain SQL. Hand-written evidence
covers what the samples lack (an XID with double-bit ECC errors, a tp group).
"""

from __future__ import annotations

import calendar
import time

import duckdb
import orjson
import pytest
from rankscope.dashboard import headline as h
from support.dashboard_store import SDC_JOB, SYNTH_JOB, shared_demo_store


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    db, _ = shared_demo_store(tmp_path_factory)
    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute("SELECT * FROM findings")
        cols = [c[0] for c in cur.description]
        rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()
    for r in rows:
        r["evidence"] = orjson.loads(r["evidence"])
    return {(r["job"], r["kind"]): r for r in rows}


def test_straggler_names_its_ratio_and_duration(findings):
    f = findings[("sample-straggler-1.6x", "straggler")]
    n = f["last_step"] - f["first_step"] + 1
    ratio = f["evidence"]["ratio"]
    assert h.evidence_line(f) == f"{ratio:.1f}x its peers' compute time for {n} steps"
    assert f"{ratio:.1f}" == "1.6"  # the injected 1.6x slowdown, as the detector measured it
    b = h.banner(f)
    assert b.level == "error" and b.headline.startswith(
        f"rank 5 on host node01: straggler since step {f['first_step']} (detected ")
    assert b.headline.endswith(", EVICT") and b.todo.startswith("drain host node01")


def test_straggler_with_a_throttling_gpu_gives_its_readings_in_units(findings):
    line = h.evidence_line(findings[(SYNTH_JOB, "straggler")])
    assert line.startswith("1.8x its peers' compute time for 40 steps; GPU throttled (")
    assert "sw_thermal" in line and "°C" in line and " W" in line and "MHz" in line


def test_sdc_vote_counts_the_other_replicas(findings):
    for job in ("sample-sdc-param", SDC_JOB):
        f = findings[(job, "sdc")]
        others = f["evidence"]["voters"] - 1
        assert h.evidence_line(f) == (f"parameters differ from the {others} other replicas "
                                      f"since step {f['first_step']}")  # fmt: skip
    assert "checkpoint taken before step 30" in h.what_to_do(findings[(SDC_JOB, "sdc")])


def test_hang_names_the_collective_and_the_rank_that_never_entered(findings):
    f = findings[("sample-hang", "hang")]
    ev = f["evidence"]
    culprit = ev["ranks"]["3"]
    assert h.evidence_line(f).startswith(
        f"{ev['n_waiting']} ranks wait in allreduce #{culprit['seq'] + 1} of dp for "
        f"{ev['stalled_s']:.0f} s, rank 3 never entered it")
    crash = h.evidence_line(findings[("sample-crash", "crash")])
    assert "rank 6 stopped reporting" in crash and crash.startswith("7 ranks wait in allreduce")


def test_gpu_health_names_the_xid_and_the_time(findings):
    f = findings[(SYNTH_JOB, "gpu")]
    line = h.evidence_line(f)
    assert "XID 79 (GPU has fallen off the bus" in line and line.startswith("GPU 1: ")
    assert line.endswith(f"at {h.when(f['detected_t'])}")
    t = calendar.timegm(time.gmtime()[:3] + (12, 3, 0))  # today 12:03 UTC
    made = {"kind": "gpu", "ranks": [2], "hosts": ["n7"], "first_step": 9, "last_step": 9,
            "detected_t": t, "action": "evict",
            "evidence": {"gpu": 2, "causes": [
                {"cause": "xid", "xid": 48, "reason": "double-bit ECC error"},
                {"cause": "ecc_dbe_growth", "before": 0, "now": 1}]}}  # fmt: skip
    assert h.evidence_line(made) == ("GPU 2: XID 48 (double-bit ECC error); double-bit ECC "
                                     "errors at 12:03 UTC")  # fmt: skip
    assert "have GPU 2 checked" in h.what_to_do(made)


def test_hang_in_a_tp_group_and_other_kinds(findings):
    made = {"kind": "hang", "ranks": [1], "hosts": ["a"], "first_step": 120, "last_step": 120,
            "evidence": {"n_waiting": 7, "stalled_s": 45.0, "ranks": {"1": {
                "op": "allreduce", "seq": 119, "done": True, "group": "dp:tp0",
                "step": 120, "busy_phase": "backward"}}, "reasons": {"1": "never entered"}}}
    assert h.evidence_line(made) == ("7 ranks wait in allreduce #120 of dp:tp0 for 45 s, rank 1 "
                                     "never entered it (last seen in backward of step 120)")
    net = h.evidence_line(findings[("sample-network", "network")])
    assert net.startswith("its peers waited ") and " ms for it in each collective" in net
    nf = h.evidence_line(findings[("sample-nonfinite", "nonfinite")])
    assert nf.startswith("its own gradient went non-finite at step 100")
    assert h.banner(findings[("sample-nonfinite", "nonfinite")]).level == "warning"


def test_odd_evidence_never_raises_and_healthy_is_green():
    for ev in ({}, {"votes": "x"}, {"ranks": [1, 2]}, {"causes": [1, None]}, {"ratio": "nan"},
               {"waiting": None, "ranks": {"3": None}}):  # fmt: skip
        for kind in ("straggler", "sdc", "hang", "crash", "gpu", "network", "nonfinite", "x"):
            line = h.evidence_line({"kind": kind, "evidence": ev, "ranks": [], "hosts": []})
            assert isinstance(line, str) and line
    assert h.banner(None).level == "ok"
    assert "no healthy majority" in h.what_to_do({"kind": "hang", "unattributed": True})
    assert h.ACTION_ORDER["evict"] < h.ACTION_ORDER["recover"] < h.ACTION_ORDER["observe"]

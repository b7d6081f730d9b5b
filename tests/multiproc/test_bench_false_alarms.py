"""The false-alarm bench's sharded, AMP and pipelined loop styles record traces that score.

One spawn of 4 real gloo ranks records eight short runs the way
``bench/bench_false_alarms.py --record`` does: an FSDP2 run and a tensor-
parallel run, each with a NaN injected on rank 1 (under tp the NaN reaches its
tp partner's gradients in the same step, but only rank 1's loss), a clean AMP
run, a clean pp 2 x dp 2 run, a clean Trainer-shaped run of variable-length
batches called with keywords (``model(**batch)``) and two clean mixture-of-experts
runs (both ways of moving tokens), and a pp run with a held straggler
(``fa_held.py``); then ``score_corpus`` replays them through the detectors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from rankscope.pipeline.traces.files import read_trace

pytestmark = pytest.mark.multiproc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

STEPS, NAN_STEP = 10, 6


def _steps(run: Path) -> dict[int, dict[int, dict]]:
    trace = read_trace(run)
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:5]]
    out: dict[int, dict[int, dict]] = {}
    for rec in trace.records:
        if rec["type"] == "step":
            out.setdefault(rec["step"], {})[rec["rank"]] = rec
    assert sorted(out) == list(range(STEPS)) and all(len(v) == 4 for v in out.values())
    return out


def test_sharded_amp_and_pipelined_styles_record_and_score(tmp_path):
    from fa_record import record_batch
    from fa_score import score_corpus

    nan = {"kind": "nonfinite", "rank": 1, "from": NAN_STEP, "until": None}
    runs = [
        {"name": "fault-nonfinite-fsdp2-0000", "style": "fsdp2", "seed": 0, "steps": STEPS,
         "fault": nan},
        {"name": "fault-nonfinite-tp-0001", "style": "tp", "seed": 1, "steps": STEPS,
         "fault": nan},
        {"name": "clean-amp-0002", "style": "amp", "seed": 2, "steps": STEPS, "fault": None},
        {"name": "clean-pp-0003", "style": "pp", "seed": 3, "steps": STEPS, "fault": None},
        {"name": "clean-varlen-0004", "style": "varlen", "seed": 4, "steps": STEPS,
         "fault": None},
        {"name": "clean-moe-0005", "style": "moe", "seed": 5, "steps": STEPS, "fault": None},
        {"name": "clean-moe-0006", "style": "moe", "seed": 6, "steps": STEPS, "fault": None},
        {"name": "fault-straggler1.5-pp-0007", "style": "pp", "seed": 7, "steps": STEPS,
         "fault": {"kind": "straggler", "factor": 1.5, "hold": True, "rank": 1, "from": 5,
                   "until": None}},
    ]  # fmt: skip
    record_batch(runs, tmp_path)

    fsdp = _steps(tmp_path / "fault-nonfinite-fsdp2-0000")[3]
    assert [fsdp[r]["shard"] for r in range(4)] == [0, 1, 2, 3]
    assert all("param_digest" not in fsdp[r] for r in range(4))  # nothing replicated
    assert {c["op"] for c in fsdp[0]["collectives"]} >= {"allgather", "reduce_scatter"}

    tp = _steps(tmp_path / "fault-nonfinite-tp-0001")
    assert [(tp[3][r]["dp"], tp[3][r]["tp"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {c["group"] for c in tp[3][0]["collectives"]} == {"dp", "tp"}
    # the NaN reaches rank 1's tp partner's local gradient in the same step, not dp peers'
    assert [tp[NAN_STEP][r]["nonfinite"] > 0 for r in range(4)] == [True, True, False, False]
    assert [tp[NAN_STEP][r].get("loss") is None for r in range(4)] == [False, True, False, False]
    labels = (tmp_path / "fault-nonfinite-tp-0001" / "labels.jsonl").read_text().splitlines()
    assert [json.loads(s)["ranks"] for s in labels] == [[1]]

    amp = _steps(tmp_path / "clean-amp-0002")
    assert all(len({amp[s][r]["param_digest"] for r in range(4)}) == 1 for s in amp)

    pp = _steps(tmp_path / "clean-pp-0003")[3]
    assert [(pp[r]["pp"], pp[r]["dp"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [pp[r].get("loss") is not None for r in range(4)] == [False, False, True, True]
    assert {c["group"] for c in pp[0]["collectives"]} == {"pp", "dp_replicate"}

    varlen = _steps(tmp_path / "clean-varlen-0004")
    tokens = [[varlen[s][r]["tokens"] for r in range(4)] for s in range(STEPS)]
    # the token ids came in as keywords; each batch padded to its own longest sequence
    assert all(t > 0 and t % 8 == 0 for row in tokens for t in row), tokens
    assert sum(len(set(row)) > 1 for row in tokens) >= STEPS // 2, tokens

    for name, tokens_moved in (("clean-moe-0005", 2), ("clean-moe-0006", 4)):  # functional, c10d
        moe = _steps(tmp_path / name)
        # the experts differ from rank to rank: only the dense replicas are digested
        assert all(len({moe[s][r]["param_digest"] for r in range(4)}) == 1 for s in moe)
        a2a = [c for c in moe[3][0]["collectives"] if c["op"] == "alltoall"]
        assert len(a2a) == 2 * (1 + tokens_moved), a2a  # per layer: counts, tokens

    s = score_corpus(tmp_path)
    assert s["clean_runs"] == {"amp": 1, "pp": 1, "varlen": 1, "moe": 2} and s["bad"] == 0
    # a held straggler (every rank posts its compute on the batch's board) records and
    # is scored under its own name, with what it measured over its stage's replica
    held = s["faults"][("straggler 1.5 held", "pp")]
    assert held["runs"] == 1 and len(held["ratio"]) == 1 and len(s["measured"]) == 1
    assert not [k for k in s["clean"] if k[0] in ("evict", "recover")], s["details"]
    hit = s["faults"][("nonfinite", "fsdp2")]
    assert hit["runs"] == 1 and hit["found"] == 1 and hit["lat"] == [0], s["details"]
    # under tp the partner's loss stayed finite: its NaN came in backward, rank 1 is named
    hit = s["faults"][("nonfinite", "tp")]
    assert hit["runs"] == 1 and hit["found"] == 1 and hit["lat"] == [0], s["details"]
    for fs in s["faults"].values():
        assert not [k for k in fs["other"] if k[0] in ("evict", "recover")], s["details"]

"""torchtitan's own trainer, unchanged, under the collector (4 gloo ranks on CPU).

``bench/titan_cpu.py`` runs ``torchtitan.train.main`` (0.3, the ``.titan``
overlay ``make titan`` installs) with the collector attached as a torchtitan
user would. Three of its parallelisms, a few steps each:

- FSDP2 x tensor parallel: every rank's records, with torchtitan's mesh
  coordinates and both groups' collectives; the replay finds nothing;
- FSDP2 x pipeline (two interleaved stages a rank): the replay finds nothing
  (its first step reduce-scatters an all-NaN lm_head gradient that the step's
  later reduction replaces: it once came out as a nonfinite observe);
- mixture of experts with expert parallel: the token dispatcher's all-to-alls,
  which it calls through a name imported before attach, are recorded, and a NaN
  is named on its own rank, not its expert-parallel partner's too.

The loss, which torchtitan keeps inside ``train_step``, is read from backward.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from rankscope.pipeline.offline.replay import replay_trace

pytestmark = pytest.mark.multiproc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_torchtitan import make_assets, run_titan, titan_lib  # noqa: E402

if titan_lib() is None:
    pytest.skip("torchtitan is not installed: run `make titan`", allow_module_level=True)


def _run(
    tmp_path: Path, style: str, steps: int, fault: dict | None = None
) -> tuple[Path, dict[int, list[dict]]]:
    trace = tmp_path / style
    log = tmp_path / f"{style}.log"
    env = {"RANKSCOPE_SINK": f"file://{trace}", "RANKSCOPE_JOB": style,
           "RANKSCOPE_FAULT": json.dumps(fault) if fault else ""}  # fmt: skip
    rc = run_titan(style, steps, make_assets(tmp_path / "assets"), log, env, timeout_s=280)
    assert rc == 0 or fault is not None, log.read_text()[-3000:]  # torchtitan stops on NaN
    by_rank: dict[int, list[dict]] = {}
    for path in trace.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["type"] == "step":
                by_rank.setdefault(rec["rank"], []).append(rec)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for recs in by_rank.values():
        recs.sort(key=lambda r: r["step"])
        assert [r["step"] for r in recs] == list(range(steps))
        assert all(r["compute_s"] > 0 and r["comm_s"] > 0 for r in recs)
    return trace, by_rank


def test_fsdp_and_tensor_parallel_records_every_rank_and_replays_clean(tmp_path):
    trace, by_rank = _run(tmp_path, "titan_fsdp_tp", 6)
    for rank, recs in by_rank.items():
        assert (recs[0]["dp"], recs[0]["tp"], recs[0]["pp"]) == (rank // 2, rank % 2, 0)
        ops = Counter(c["op"] for r in recs for c in r["collectives"])
        assert ops["reduce_scatter"] and ops["allgather"] and ops["allreduce"], ops
        assert all(r.get("grad_norm") is not None for r in recs)
        # torchtitan keeps its loss inside train_step: read from backward's root (the
        # loss-parallel DTensor, replicated over tp)
        assert all(r["loss"] > 0 for r in recs)
    assert replay_trace(trace).findings == []


def test_pipeline_stages_record_and_replay_clean(tmp_path):
    trace, by_rank = _run(tmp_path, "titan_pp", 4)
    for rank, recs in by_rank.items():
        assert (recs[0]["dp"], recs[0]["pp"]) == (rank % 2, rank // 2)
        ops = Counter(c["op"] for r in recs for c in r["collectives"])
        assert ops["send"] and ops["recv"], ops
        # step 0's metadata inference (a backward on made-up labels, NaN loss) is not
        # this rank's gradient: every step's local norm is finite
        assert all(r.get("grad_norm") is not None and not r.get("nonfinite") for r in recs), [
            (r["step"], r.get("grad_norm"), r.get("nonfinite")) for r in recs]
        # the loss is the last stage's (its schedule's backward from the loss); an earlier
        # stage's backward starts from the gradient it received: no loss
        assert all((r.get("loss") is not None) == (rank >= 2) for r in recs), rank
    assert replay_trace(trace).findings == []


def test_expert_parallel_all_to_alls_are_recorded_and_a_nan_is_named_on_its_rank(tmp_path):
    """Rank 1's logits go NaN at step 2: the backward's all-to-all carries the NaN into
    its expert-parallel partner's experts in the same step, but the partner's loss (read
    from backward's root: torchtitan reports none) stayed finite, so only rank 1 is named."""
    trace, by_rank = _run(tmp_path, "titan_moe_ep", 3, {"kind": "nonfinite", "rank": 1, "from": 2})
    for recs in by_rank.values():
        for r in recs:
            assert sum(c["op"] == "alltoall" for c in r["collectives"]) >= 2, r["collectives"]
        assert all(r["loss"] > 0 for r in recs[:2])
    assert by_rank[1][2]["nonfinite_fields"]["loss"] == "NaN"
    assert [by_rank[r][2]["nonfinite"] > 0 for r in range(4)] == [True, True, False, False]
    found = [(f.kind, f.ranks, f.first_step, f.unattributed) for f in replay_trace(trace).findings]
    assert found == [("nonfinite", [1], 2, False)]

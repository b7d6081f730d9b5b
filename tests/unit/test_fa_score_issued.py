"""The false-alarm bench counts a finding under the strongest action it ever issued: an
incident that sent an evict and ended as ``observe`` is still an eviction (the trainer
acted on it), so the clean-run evict rate cannot hide it."""

from __future__ import annotations

import sys
from pathlib import Path

from rankscope.pipeline.engine.findings import Finding

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fa_score import issued  # noqa: E402


def _finding(action: str, actions: dict | None = None) -> Finding:
    ev = {"actions": actions} if actions is not None else {}
    return Finding(job="j", kind="straggler", ranks=[3], hosts=["h"], first_step=50,
                   last_step=149, detected_step=51, detected_t=0.0, score=4.0,
                   detector="straggler", action=action, evidence=ev)  # fmt: skip


def test_an_evict_sent_then_downgraded_counts_as_evict():
    assert issued(_finding("observe", {"evict": {"step": 55, "t": 1.0}})) == "evict"
    sdc = {"recover": {"step": 90, "t": 1.0}, "evict": {"step": 95, "t": 2.0}}
    assert issued(_finding("evict", sdc)) == "evict"
    assert issued(_finding("observe", {"recover": {"step": 9, "t": 1.0}})) == "recover"


def test_without_issued_actions_the_final_action_counts():
    assert issued(_finding("observe")) == "observe"
    assert issued(_finding("recover", {})) == "recover"

"""The committed sample traces: readable, labelled, small, and telling the story they claim."""

from __future__ import annotations

from collections import defaultdict

import pytest
from rankscope.pipeline.traces.files import read_trace
from support.paths import SAMPLE_TRACES

ROOT = SAMPLE_TRACES
TRACES = sorted(p for p in ROOT.iterdir() if (p / "meta.json").is_file()) if ROOT.is_dir() else []
EXPECTED_KINDS = {
    "clean-dp8": [], "clean-3d": [], "straggler-1.6x": ["straggler"],
    "straggler-1.25x": ["straggler"], "straggler-1.25x-backward": ["straggler"],
    "network": ["network"], "sdc-grad": ["sdc"],
    "sdc-param": ["sdc"], "sdc-reduce": ["sdc"], "nonfinite": ["nonfinite"], "hang": ["hang"],
    "crash": ["crash"], "gpu-thermal": ["gpu"],
}


def test_every_kind_has_a_small_sample():
    assert sorted(p.name for p in TRACES) == sorted(EXPECTED_KINDS)
    total = sum(f.stat().st_size for p in TRACES for f in p.iterdir())
    assert total <= 3 * 1024 * 1024
    assert (ROOT / "README.md").is_file()
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{p.name}`" in readme for p in TRACES)


@pytest.mark.parametrize("trace_dir", TRACES, ids=lambda p: p.name)
def test_sample_trace(trace_dir):
    trace = read_trace(trace_dir)
    assert trace.report.bad == 0, [str(e) for e in trace.report.errors[:3]]
    assert all(f.name.endswith(".jsonl.gz") or f.name in ("labels.jsonl", "meta.json")
               for f in trace_dir.iterdir())
    meta = trace.meta[0]
    assert meta["world"] == 8 and meta["steps"] == 150
    assert [lab["kind"] for lab in trace.labels] == EXPECTED_KINDS[trace_dir.name]
    steps: dict[int, dict[int, dict]] = defaultdict(dict)
    beats = defaultdict(int)
    for rec in trace.records:
        if rec["type"] == "step":
            steps[rec["step"]][rec["rank"]] = rec
        elif rec["type"] == "beat":
            beats[rec["rank"]] += 1
    assert sorted(beats) == list(range(8))
    stops = meta["ended"] in ("hang", "crash")
    assert meta["ended"] == (trace.labels[0]["kind"] if stops else "completed")
    if not stops:
        assert sorted(steps) == list(range(150))
    first = trace.labels[0]["step"] if trace.labels else 150
    for s in range(min(first, max(steps) + 1)):
        row = steps[s]
        if len(row) < 8:  # the last steps before a crash may be lost with the process
            continue
        assert len({r["param_digest"] for r in row.values()}) == 1, s
        assert len({r["grad_norm_reduced"] for r in row.values()}) == 1, s
        assert len({r["grad_norm"] for r in row.values()}) == 8, s

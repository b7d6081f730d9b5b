"""Loss is visible: what a job lost on the way is stored per job and shown by `rankscope
findings`; the open score bucket survives a checkpoint (a kill -9 lost a step of scores)."""

from __future__ import annotations

import json

import numpy as np
from rankscope.pipeline.cli import main
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.serve.guard import dump_state
from rankscope.pipeline.store import Store
from rankscope.pipeline.traces.validate import parse_json
from support.engine_synth import make_records


def test_loss_counts_are_stored_per_job_and_shown_by_findings(tmp_path, capsys):
    """Through the one engine-to-store writer (replay, the demo and serve all use it)."""
    recs = make_records(job="lossy", dp=4, tp=1, steps=30, ranks_per_host=2)
    for r in recs:
        if r["step"] == 10:
            r["dropped"] = 7  # each collector says it dropped 7 records
    end = max(r["t"] for r in recs)
    late = [{**r, "t": end} for r in recs if r["step"] == 3]  # again after step 3 was built
    gone = [r for r in recs if not (r["step"] == 20 and r["rank"] == 2)]  # a partial step
    eng = Engine()
    eng.feed(gone)
    eng.feed(late)  # a batch of its own: step 3 is built by then
    eng.flush()
    db = tmp_path / "s.duckdb"
    with Store(db) as store:
        store.write_turn(findings=eng.findings(), jobs=[eng.job_summary("lossy")])
    with Store(db, read_only=True) as store:
        (job,) = store.list_jobs()
    assert (job["dropped"], job["late"], job["partial_frames"]) == (28, 4, 1)
    assert main(["findings", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "job lossy: lost on the way: 4 late, 1 partial frames, 28 dropped" in out


def _rows(chunks):
    out = set()
    for c in chunks:
        for i in range(len(c["rank"])):
            out.add((int(c["step"][i]), int(c["rank"][i]), str(c["metric"][i]),
                     round(float(c["score"][i]), 9)))  # fmt: skip
    return out


def test_the_open_score_bucket_is_part_of_the_checkpoint():
    recs = make_records(job="sc", dp=8, tp=1, steps=40, ranks_per_host=2, straggler=(5, 10, 2.0))
    whole = Engine()
    whole.feed(recs)
    whole.flush()
    want = _rows(whole.drain_scores(final=True))
    assert want

    first = Engine()
    first.feed([r for r in recs if r["step"] < 25])
    got = _rows(first.drain_scores())  # what serve stores with the checkpoint
    state = dump_state(first.state_dict())  # then kill -9: only the checkpoint is left
    assert json.loads(state)["jobs"]["sc"]["scores"]["acc"]
    second = Engine()
    second.load_state_dict(parse_json(state))
    second.feed([r for r in recs if r["step"] >= 25])
    second.flush()
    got |= _rows(second.drain_scores(final=True))
    assert got == want
    assert np.isfinite([s for *_x, s in got]).all()

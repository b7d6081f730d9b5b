"""Duplicates of a (job, rank, step): the last record wins for the fields it carries, and a
duplicate lacking fields cannot fake evidence the rank did not report."""

from __future__ import annotations

from rankscope.pipeline.engine.engine import Engine
from support.engine_synth import make_records


def _findings(records):
    eng = Engine()
    eng.feed(records)
    eng.flush()
    return {(f.kind, tuple(f.ranks), f.first_step, f.action) for f in eng.findings()}, eng


def test_a_duplicate_lacking_loss_and_grad_norm_changes_nothing():
    recs = make_records(job="dup", dp=8, tp=1, steps=40, ranks_per_host=2)
    clean, _ = _findings(recs)
    r = next(x for x in recs if x["step"] == 20 and x["rank"] == 3)
    assert "loss" in r and "grad_norm" in r
    stripped = {k: v for k, v in r.items() if k not in ("loss", "grad_norm")}
    got, eng = _findings(recs + [stripped])  # once: a job-wide "recover"
    assert got == clean
    assert not any(a == "recover" for *_x, a in got)
    assert eng.stats("dup")["duplicates"] == 1


def test_a_duplicate_still_updates_the_fields_it_carries():
    recs = make_records(job="dup2", dp=8, tp=1, steps=30, ranks_per_host=2)
    step = [x for x in recs if x["step"] == 29]
    eng = Engine()
    eng.feed([x for x in recs if x["step"] < 29])
    eng.assembler.add_records(step + [{**step[3], "compute_s": 99.0, "loss": float("nan")}])
    (frame,) = eng.assembler.flush()
    row = int((frame.rank == step[3]["rank"]).nonzero()[0][0])
    assert frame.m["compute_s"][row] == 99.0  # the later value of a field it carries
    assert frame.m["loss"][row] == step[3]["loss"]  # NaN does not overwrite a reported value

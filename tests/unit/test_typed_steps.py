"""The typed decode of step arrays (``bus/decode.typed_step_columns``, msgspec) never
accepts what the old columnar check (orjson dicts + ``uniform_columns``) refuses, and
gives the same columns when both accept: the same mutation applied to every record of
a message, so the message keeps one shape and the columnar paths are what is judged."""

from __future__ import annotations

import json

import orjson
from hypothesis import HealthCheck, given, settings
from rankscope.pipeline.bus.decode import decode_message, typed_step_columns, uniform_columns
from support.engine_synth import one_step_record as _step
from test_validate_fuzz import mutations, orjson_like

BUDGET = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


def _message(muts, n=8, drop=()):
    recs = []
    for i in range(n):
        rec = _step(rank=i % 4, step=i // 4)
        for name, value in muts:
            rec[name] = value
        for name in drop:
            rec.pop(name, None)
        recs.append(rec)
    return json.dumps(recs).encode()


def _old_columns(value):
    try:
        recs = [orjson_like(r) for r in json.loads(value)]
        orjson.loads(value)
    except ValueError:
        return None  # orjson refuses the value (a NaN token): the old path parses it apart
    return uniform_columns(recs)


@BUDGET
@given(mutations)
def test_typed_columns_are_the_old_columns_or_nothing(muts):
    value = _message(muts)
    typed = typed_step_columns(value, 1)
    old = _old_columns(value)
    if typed is None:
        return
    assert old is not None, "typed decode accepted what the old check refuses"
    known = {k: v for k, v in old.items() if k in typed}
    assert set(old) - set(known) <= {"extra"}  # unknown fields refuse the typed path
    assert {k: list(v) for k, v in typed.items()} == known


def test_the_common_message_takes_the_typed_path_and_odd_ones_do_not():
    assert typed_step_columns(_message([]), 8) is not None
    assert typed_step_columns(_message([]), 9) is None  # fewer records than asked for
    assert typed_step_columns(_message([("step", 3.0)]), 1) is None  # float in an int field
    assert typed_step_columns(_message([("rank", True)]), 1) is None
    assert typed_step_columns(_message([("loss", None)]), 1) is None
    assert typed_step_columns(_message([("extra", 1)]), 1) is None
    assert typed_step_columns(_message([("v", 2)]), 1) is None
    assert typed_step_columns(_message([("t", float("nan"))]), 1) is None  # a NaN token
    mixed = json.loads(_message([]))
    del mixed[3]["compute_s"]
    assert typed_step_columns(json.dumps(mixed).encode(), 1) is None  # not one shape
    # and each odd one still decodes the old way, with the same verdict as before
    good, bad = [], []
    assert decode_message(json.dumps(mixed).encode(), good, bad, min_columns=4) is None
    assert len(good) == 8 and not bad


@BUDGET
@given(mutations)
def test_the_last_shape_decoder_gives_what_the_general_decode_gives(muts):
    """The second message of a shape takes the decoder of that shape (``decode._Shape``);
    its answer is the general decode's, and so is the answer for a message of another
    shape that follows it."""
    value = _message(muts)
    first = typed_step_columns(value, 1)
    again = typed_step_columns(value, 1)
    assert (first is None) == (again is None)
    if first is not None:
        assert {k: list(v) for k, v in again.items()} == {k: list(v) for k, v in first.items()}
    other = _message([], drop=("loss",))
    assert typed_step_columns(other, 1) is not None  # one shape, the previous one's or not


def test_a_cached_shape_refuses_records_of_another_shape():
    base = _message([])
    assert typed_step_columns(base, 1) is not None
    assert typed_step_columns(base, 1) is not None  # now from the cached shape
    mixed = json.loads(base)
    del mixed[3]["compute_s"]
    assert typed_step_columns(json.dumps(mixed).encode(), 1) is None  # not one shape
    extra = json.loads(base)
    extra[5]["dropped"] = 1  # a known optional field on one record only
    assert typed_step_columns(json.dumps(extra).encode(), 1) is None
    v2 = json.loads(base)
    v2[2]["v"] = 2
    assert typed_step_columns(json.dumps(v2).encode(), 1) is None
    assert typed_step_columns(base, 1) is not None

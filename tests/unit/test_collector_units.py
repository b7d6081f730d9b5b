"""Single-process tests of the collector's parts: config, topology, digest,
sinks, the never-blocking sender, and the attach/step path without DDP."""

from __future__ import annotations

import logging
import queue
import time

import pytest
import torch
import torch.distributed as dist
from rankscope.collectors import CollectorConfig, RankCollector, Sender, make_sink
from rankscope.collectors.rank.digest import digest_hex, digest_sums
from rankscope.collectors.rank.topology import coordinates, parse_topology, resolve_identity
from rankscope.collectors.schema.records import validate_record
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel
from rankscope.collectors.sinks.file import FileSink
from rankscope.pipeline.traces.files import read_trace
from support.sinks import FailingSink, StalledSink

# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("beat_interval_s", 0),
        ("queue_size", 0),
        ("batch_max_records", 0),
        ("flush_interval_s", -1),
        ("close_timeout_s", -1),
        ("digest_every_steps", -1),
        ("ddp_group_name", ""),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        CollectorConfig(**{field: value})


# -------------------------------------------------------------- topology


def test_topology_sizes_and_megatron_coordinates():
    assert parse_topology("dp=2,tp=2,pp=2", 8) == {"dp": 2, "tp": 2, "pp": 2}
    assert parse_topology({"tp": 2, "pp": 2}, 8)["dp"] == 2  # dp inferred
    sizes = parse_topology("tp=2,dp=2,pp=2", 8)
    # tp fastest, then dp, pp slowest
    assert coordinates(sizes, 0) == {"tp": 0, "dp": 0, "pp": 0}
    assert coordinates(sizes, 1) == {"tp": 1, "dp": 0, "pp": 0}
    assert coordinates(sizes, 2) == {"tp": 0, "dp": 1, "pp": 0}
    assert coordinates(sizes, 7) == {"tp": 1, "dp": 1, "pp": 1}
    assert coordinates(parse_topology("tp=2,cp=2", 8), 6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}


@pytest.mark.parametrize(
    "spec, match",
    [
        ("dp=3,tp=2", "multiply to 6"),
        ("tp=3", "not divisible"),
        ("xp=2", "unknown axis"),
        ("dp=two", "not an integer"),
        ("dp", "AXIS=SIZE"),
        ("dp=0", ">= 1"),
    ],
)
def test_topology_errors_say_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_topology(spec, 8)


def test_identity_from_environment(monkeypatch):
    monkeypatch.setenv("RANKSCOPE_TOPOLOGY", "tp=2")
    monkeypatch.setenv("RANKSCOPE_HOST", "node-7")
    ident = resolve_identity(rank=5, world=8, host=None, topology=None)
    assert ident.host == "node-7"
    assert ident.coords == {"tp": 1, "dp": 2, "pp": 0}
    assert resolve_identity(rank=5, world=8, host="h", topology="pp=2").coords == {
        "tp": 0,
        "dp": 1,
        "pp": 1,
    }
    monkeypatch.delenv("RANKSCOPE_TOPOLOGY")
    plain = resolve_identity(rank=3, world=4, host=None, topology=None)
    assert plain.coords == {"dp": 3, "tp": 0, "pp": 0}
    with pytest.raises(ValueError, match="outside world"):
        resolve_identity(rank=4, world=4, host=None, topology=None)


# ---------------------------------------------------------------- digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_digest_sees_every_single_bit_flip(dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(37, 11, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
    clean = digest_hex(digest_sums(params))
    assert clean == digest_hex(digest_sums([p.clone() for p in params]))
    width = params[0].element_size() * 8
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[params[0].element_size()]
    for bit in range(width):
        for which, index in ((0, 0), (0, 200), (1, 4)):
            corrupt = [p.clone() for p in params]
            flat = corrupt[which].view(-1).view(int_dtype)
            flat[index] ^= torch.tensor(1, dtype=int_dtype) << bit
            assert digest_hex(digest_sums(corrupt)) != clean, (dtype, bit, which, index)


# ----------------------------------------------------------------- sinks


@pytest.mark.parametrize(
    "url, match",
    [
        ("nosuch://x", "unknown sink URL scheme 'nosuch'"),
        ("", "empty sink URL"),
        ("file://", "names no directory"),
        ("file://{tmp}?max_mb=big", "max_mb must be a number"),
        ("file://{tmp}?max_mb=0", "max_mb must be > 0"),
        ("file://{tmp}?colour=red", "unknown option"),
        ("embedded://never-registered", "no channel 'never-registered' registered"),
        ("embedded://a/b", "expected embedded://NAME"),
    ],
)
def test_bad_sink_url_fails_at_attach_with_a_clear_message(tmp_path, url, match):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=match) as err:
        RankCollector.attach(
            model, job="j", sink=url.format(tmp=tmp_path), rank=0, world=1, host="h"
        )
    assert "bad sink" in str(err.value)
    assert dist.all_reduce.__name__ == "all_reduce" and not hasattr(
        dist.all_reduce, "__rankscope_wrapped__"
    )


def test_sink_object_must_have_the_methods():
    with pytest.raises(ValueError, match="lacks method"):
        make_sink(object())


def _rec(i: int, pad: int = 100) -> dict:
    return {
        "v": 1,
        "type": "beat",
        "job": "j",
        "rank": 3,
        "host": "h",
        "t": float(i),
        "step": i,
        "phase": "idle",
        "coll_op": "x" * pad,
    }


def test_file_sink_rotates_by_size_and_keeps_every_line(tmp_path):
    sink = make_sink(f"file://{tmp_path}/tr?max_mb=0.001")  # about 1 KB per file
    assert isinstance(sink, FileSink)
    for i in range(0, 60, 6):
        sink.send([_rec(j) for j in range(i, i + 6)])
    sink.close()
    files = sorted((tmp_path / "tr").glob("*.jsonl"))
    assert len(files) >= 5
    assert all(f.name.startswith("rank00003-p") for f in files)
    assert all(f.stat().st_size <= sink.max_bytes for f in files)
    trace = read_trace(tmp_path / "tr")
    assert trace.report.bad == 0
    assert sorted(r["step"] for r in trace.records) == list(range(60))


def test_file_sink_is_flushed_while_running_and_at_close(tmp_path):
    sink = make_sink(f"file://{tmp_path}")
    sender = Sender(sink, queue_size=100, batch_max_records=10, flush_interval_s=0.1)
    sender.put(_rec(0))
    deadline = time.monotonic() + 10
    lines = []
    while time.monotonic() < deadline and not lines:
        time.sleep(0.05)
        lines = [ln for f in tmp_path.glob("*.jsonl") for ln in f.read_text().splitlines()]
    assert len(lines) == 1  # visible without closing: the periodic flush wrote it
    for i in range(1, 50):
        sender.put(_rec(i))
    assert sender.close(5.0)
    assert len(read_trace(tmp_path).records) == 50


def test_embedded_sink_puts_batches_on_the_registered_channel():
    q: queue.Queue = queue.Queue()
    register_channel("units-emb", q)
    try:
        sink = make_sink("embedded://units-emb")
        sink.send([_rec(1), _rec(2)])
        sink.send([_rec(3)])
        assert [r["step"] for r in iter_channel(q)] == [1, 2, 3]
    finally:
        unregister_channel("units-emb")


# ---------------------------------------------------------------- sender


def _train(rc: RankCollector | None, model, opt, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        if rc is not None:
            rc.loss(loss)
        opt.step()


def test_stalled_sink_never_stalls_the_loop_and_drops_are_counted():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = StalledSink()
    rc = RankCollector.attach(
        model,
        opt,
        job="stall",
        sink=sink,
        rank=0,
        world=1,
        host="h",
        queue_size=8,
        beat_interval_s=0.05,
    )
    _train(rc, model, opt, 20)
    assert sink.entered.wait(10)  # the sender is now stuck inside the sink
    steps = 300
    _train(rc, model, opt, steps - 20)
    # the loop ran on while the sink was stuck in its first send
    assert sink.entered.is_set() and not sink.release.is_set() and not sink.records
    stats = rc.stats
    assert stats.dropped_queue_full >= steps - 8 - rc.config.batch_max_records
    sink.release.set()
    rc.close()
    stats = rc.stats
    assert stats.sent == len(sink.records)
    assert stats.sent + stats.dropped == stats.enqueued
    # every loss is accounted for: delivered records carry the drop count
    assert sum(r.get("dropped", 0) for r in sink.records) == stats.dropped
    steps_seen = [r["step"] for r in sink.records if r["type"] == "step"]
    assert steps - 1 in steps_seen  # the newest survive, the oldest were dropped


def test_close_gives_up_on_a_sink_that_never_returns(caplog):
    sink = StalledSink()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(
        model,
        opt,
        job="hung",
        sink=sink,
        rank=0,
        world=1,
        config=CollectorConfig(close_timeout_s=0.2),
    )
    _train(rc, model, opt, 3)
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        rc.close()  # returns although the sink is still stuck
    assert not sink.release.is_set()
    assert any("still stalled" in r.getMessage() for r in caplog.records)
    sink.release.set()


def test_sink_errors_are_logged_once_counted_and_never_raised(caplog):
    sink = FailingSink(failures=3)
    sender = Sender(sink, queue_size=100, batch_max_records=1, flush_interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        for i in range(6):
            sender.put(_rec(i))
        assert sender.close(5.0)
    assert sender.stats.send_errors == 3 and sender.stats.dropped_send_failed == 3
    assert [r["step"] for r in sink.records] == [3, 4, 5]
    assert sink.records[0]["dropped"] == 3  # the next delivered record says what was lost
    sends = [r for r in caplog.records if "sink send" in r.getMessage()]
    assert len(sends) == 1
    assert sender.stats.flush_errors >= 1


def test_a_record_that_fails_to_build_loses_only_itself():
    sink = FailingSink(failures=0)
    sender = Sender(sink, queue_size=10, batch_max_records=10, flush_interval_s=5)
    sender.put(lambda: 1 / 0)
    sender.put(_rec(7))
    sender.close(5.0)
    assert [r["step"] for r in sink.records] == [7]
    assert sink.records[0]["dropped"] == 1


# ------------------------------------------------ attach without DDP / rc.step


def _collect(name: str):
    q: queue.Queue = queue.Queue()
    register_channel(name, q)
    return q


def test_plain_module_records_local_grad_norm_and_restores_dist():
    q = _collect("units-plain")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    opt.register_step_pre_hook(
        lambda o, a, k: norms.append(
            float(
                torch.linalg.vector_norm(torch.cat([p.grad.view(-1) for p in model.parameters()]))
            )
        )
    )
    original = dist.all_reduce
    rc = RankCollector.attach(
        model,
        opt,
        job="plain",
        sink="embedded://units-plain",
        rank=1,
        world=2,
        host="h0",
        topology="dp=2",
    )
    assert dist.all_reduce is not original
    _train(rc, model, opt, 5)
    rc.close()
    assert dist.all_reduce is original
    unregister_channel("units-plain")
    records = [validate_record(r) for r in iter_channel(q)]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(5))
    for r, expected in zip(steps, norms, strict=True):
        assert r["grad_norm"] == pytest.approx(expected, rel=1e-5)
        assert r["nonfinite"] == 0 and r["rank"] == 1 and r["dp"] == 1 and r["host"] == "h0"
        assert len(r["param_digest"]) == 16 and r["loss"] >= 0
    assert records[-1]["type"] == "beat" and records[-1]["phase"] == "idle"


def test_step_boundary_by_rc_step_and_nonfinite_count():
    q = _collect("units-step")
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, job="s", sink="embedded://units-step", rank=0, world=1)
    for i in range(3):
        opt.zero_grad()
        loss = model(torch.ones(2, 8)).sum()
        loss.backward()
        if i == 2:
            model.weight.grad[0, :3] = float("nan")
        opt.step()
        rc.step(loss)
    rc.close()
    unregister_channel("units-step")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert [r["nonfinite"] for r in steps] == [0, 0, 3]
    # not finite: written as null and named, so "NaN" stays distinct from "not reported"
    # (it used to be left out, which dropped the evidence without a word)
    assert steps[2]["grad_norm"] is None and steps[2]["nonfinite_fields"] == {"grad_norm": "NaN"}
    assert all("nonfinite_fields" not in r for r in steps[:2])
    assert all("loss" in r for r in steps)


def test_nonfinite_loss_is_written_as_null_and_named_in_the_file(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="nf", sink=f"file://{tmp_path}", rank=0, world=1)
    for value in (1.0, float("nan"), float("-inf")):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        rc.loss(torch.tensor(value))
    rc.close()
    lines = [ln for f in sorted(tmp_path.glob("*.jsonl")) for ln in f.read_text().splitlines()]
    assert all("NaN" not in ln or "nonfinite_fields" in ln for ln in lines)
    trace = read_trace(tmp_path)
    steps = sorted((r for r in trace.records if r["type"] == "step"), key=lambda r: r["step"])
    assert trace.report.bad == 0 and [validate_record(dict(r))["step"] for r in steps] == [0, 1, 2]
    assert steps[0]["loss"] == 1.0 and "nonfinite_fields" not in steps[0]
    assert steps[1]["loss"] is None and steps[1]["nonfinite_fields"] == {"loss": "NaN"}
    assert steps[2]["nonfinite_fields"] == {"loss": "-Infinity"}


def test_tokens_counted_from_integer_inputs_or_reported_and_huge_norms_stay_finite():
    q = _collect("units-tokens")
    emb, head = torch.nn.Embedding(16, 4), torch.nn.Linear(12, 1)
    model = torch.nn.Sequential(emb, torch.nn.Flatten(), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rc = RankCollector.attach(model, opt, job="t", sink="embedded://units-tokens", rank=0, world=1)
    for i, n in enumerate((2, 5, 3)):
        opt.zero_grad()
        loss = model(torch.zeros(n, 3, dtype=torch.long)).sum()
        loss.backward()
        if i == 1:
            rc.tokens(1000)  # explicit count wins over the counted ids
        if i == 2:  # an exponent bit flip: squaring 1e30 overflows float32, not float64
            head.weight.grad[0, 0] = 1e30
        opt.step()
        rc.loss(loss)
    rc.close()
    unregister_channel("units-tokens")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["tokens"] for r in steps] == [6, 1000, 9]
    assert steps[2]["grad_norm"] == pytest.approx(1e30, rel=1e-6)


class _KeywordModel(torch.nn.Module):
    """Called the Hugging Face way, ``model(**batch)``: ids, a mask and labels."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(16, 4), torch.nn.Linear(4, 3)

    def forward(self, input_ids=None, attention_mask=None, labels=None, pixel_values=None):
        if pixel_values is not None:
            return {"loss": self.head(pixel_values).sum()}
        h = (self.emb(input_ids) * attention_mask[..., None]).mean(1)
        return {"loss": torch.nn.functional.cross_entropy(self.head(h), labels)}


def _tokens_per_step(model, batches, call) -> list:
    """The ``tokens`` of the records of one step per batch (``call(model, batch, i)``:
    the forward, returning the loss)."""
    q = _collect("units-tokens-of")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rc = RankCollector.attach(model, opt, job="t", sink="embedded://units-tokens-of", rank=0,
                              world=1)  # fmt: skip
    for i, batch in enumerate(batches):
        opt.zero_grad()
        call(model, batch, i).backward()
        opt.step()
    rc.close()
    unregister_channel("units-tokens-of")
    return [r.get("tokens") for r in iter_channel(q) if r["type"] == "step"]


def test_tokens_counted_from_keyword_ids_not_from_masks_labels_or_float_inputs():
    ids = [torch.ones(2, 7, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)]
    batches = [  # dynamic padding: each batch as long as its longest sequence
        {"input_ids": ids[0], "labels": torch.zeros(2, dtype=torch.long),
         "attention_mask": torch.ones_like(ids[0])},
        {"labels": torch.zeros(4, dtype=torch.long), "attention_mask": torch.ones_like(ids[1]),
         "input_ids": ids[1]},
        {"pixel_values": torch.ones(2, 4)},  # a float input: no token count
    ]  # fmt: skip
    tokens = _tokens_per_step(_KeywordModel(), batches, lambda m, b, i: m(**b)["loss"])
    assert tokens == [14, 12, None]


class _BatchModel(torch.nn.Module):
    """Lightning's shape: the whole batch (a dict or a tuple) and its index, by position."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, batch, batch_idx):
        items = batch.values() if isinstance(batch, dict) else batch
        return self.emb(next(t for t in items if t.dtype == torch.long and t.dim() == 2)).sum()


def test_tokens_counted_inside_a_batch_passed_by_position():
    long = torch.ones(3, 5, dtype=torch.long)
    batches = [{"attention_mask": torch.ones_like(long), "input_ids": long},
               (torch.ones(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)),
               [torch.ones(2, 4), torch.ones(2, 4, dtype=torch.long)]]  # fmt: skip
    # the last: float features first, no tokens (the labels are no token ids)
    assert _tokens_per_step(_BatchModel(), batches, lambda m, b, i: m(b, i)) == [15, 8, None]


def test_an_optimizer_wrapper_is_hooked_through_the_optimizer_it_holds():
    class Wrapper:  # Lightning's LightningOptimizer holds its optimizer as ``_optimizer``
        def __init__(self, opt):
            self._optimizer = opt

        def step(self):
            self._optimizer.step()

    q = _collect("units-wrapped-opt")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rc = RankCollector.attach(model, Wrapper(opt), job="t", sink="embedded://units-wrapped-opt",
                              rank=0, world=1)  # fmt: skip
    for _ in range(3):
        model(torch.ones(2, 3)).sum().backward()
        Wrapper(opt).step()
    rc.close()
    unregister_channel("units-wrapped-opt")
    assert [r["step"] for r in iter_channel(q) if r["type"] == "step"] == [0, 1, 2]
    with pytest.raises(ValueError, match="RankCollector.attach: optimizer: a object is not"):
        RankCollector.attach(model, object(), job="t", sink="embedded://x", rank=0, world=1)

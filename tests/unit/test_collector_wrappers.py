"""Single-process tests of what attach makes of wrappers, topology objects and its
own failures; the replica vote by shard. Multi-rank wrappers (FSDP2, HSDP, TP)
run for real in ``tests/multiproc/test_loop_styles.py``."""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rankscope.collectors import RankCollector
from rankscope.collectors.rank.topology import resolve_identity
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel
from rankscope.detectors.votes import digest as digest_vote
from support.synth import layout, make_frame, run_detector


class _WithUnreadableParam(torch.nn.Module):
    """A real module with one parameter on the meta device: the digest cannot read it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.ghost = torch.nn.Parameter(torch.empty(3, device="meta"))

    def forward(self, x):
        return self.lin(x)


def test_a_failing_field_is_left_out_counted_and_said_once(caplog):
    q: queue.Queue = queue.Queue()
    register_channel("wrap-fail", q)
    model = _WithUnreadableParam()
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        rc = RankCollector.attach(model, opt, job="f", sink="embedded://wrap-fail", rank=0,
                                  world=1)  # fmt: skip
        for _ in range(4):
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            rc.loss(loss)
            opt.step()
        rc.close()
    unregister_channel("wrap-fail")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]  # the records kept flowing
    assert all("param_digest" not in r and "grad_norm" in r for r in steps)
    assert rc.faults.get("param_digest") == 4
    said = [r for r in caplog.records if "param_digest failed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


@dataclass
class TitanDims:  # the attributes torchtitan's ParallelDims carries
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int = 1


@dataclass
class MegatronArgs:  # the names Megatron's arguments use
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int


def test_topology_from_torchtitan_and_megatron_parallel_dims():
    ident = resolve_identity(rank=5, world=8, host="h", topology=TitanDims(1, -1, 1, 2, 2))
    assert ident.sizes == {"tp": 2, "pp": 2, "dp": 2}
    assert ident.coords == {"dp": 0, "tp": 1, "pp": 1}  # tp fastest, pp slowest
    ident = resolve_identity(rank=6, world=8, host="h", topology=MegatronArgs(2, 1))
    assert ident.sizes == {"tp": 2, "dp": 4} and ident.coords == {"dp": 3, "tp": 0, "pp": 0}


def test_digest_vote_compares_only_replicas_of_one_shard():
    """HSDP 3 x 2: shard 0 on even ranks, shard 1 on odd ranks; rank 3 flipped."""
    lay = layout(dp=6)
    shard = np.array([0, 1, 0, 1, 0, 1], dtype=np.float64)
    frames = []
    for step in range(6):
        dig = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
        if step >= 3:
            dig[3] = "x"
        frames.append(make_frame(lay, step, {"shard": shard}, digest=dig))
    outs, _ = run_detector(digest_vote, frames)
    blamed = {(f.step, tuple(s.ranks)) for f, o in zip(frames, outs, strict=True)
              for s in o.signals}  # fmt: skip
    assert blamed == {(3, (3,)), (4, (3,)), (5, (3,))}
    # without the shard column the two shards never agree: nothing is voted
    plain = [make_frame(lay, f.step, digest=f.digest) for f in frames]
    assert not any(o.signals for o in run_detector(digest_vote, plain)[0])


def test_torch_compiled_module_is_attached_through_its_wrapper():
    q: queue.Queue = queue.Queue()
    register_channel("wrap-compile", q)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = torch.compile(inner, backend="eager")  # dynamo, no C++ toolchain needed
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    opt.register_step_pre_hook(lambda o, a, k: norms.append(
        float(torch.linalg.vector_norm(torch.cat([p.grad.view(-1) for p in inner.parameters()])))
    ))  # fmt: skip
    rc = RankCollector.attach(model, opt, job="c", sink="embedded://wrap-compile", rank=0, world=1)
    for i in range(3):
        opt.zero_grad()
        loss = model(torch.full((2, 4), float(i + 1))).sum()
        loss.backward()
        rc.loss(loss)
        opt.step()
    rc.close()
    unregister_channel("wrap-compile")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2] and not rc.faults
    assert [r["grad_norm"] for r in steps] == [pytest.approx(n, rel=1e-5) for n in norms]
    assert len({r["param_digest"] for r in steps}) == 3  # the weights moved every step


def test_attached_collector_leaves_point_to_point_ops_usable():
    """Pipeline schedules build ``P2POp(dist.isend, ...)``, which refuses any op that is
    not ``distributed_c10d``'s own isend/irecv: the wrappers replace those too, so the
    check passes, and close puts the originals back in both places."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    model = torch.nn.Linear(2, 1)
    orig_isend, orig_irecv = c10d.isend, c10d.irecv
    register_channel("wrap-p2p", queue.Queue())
    rc = RankCollector.attach(model, job="p", sink="embedded://wrap-p2p", rank=0, world=1)
    try:
        # exactly P2POp's check (``op in [isend, irecv]`` against c10d's own)
        assert dist.isend is c10d.isend and dist.irecv is c10d.irecv
        assert getattr(dist.isend, "__rankscope_wrapped__", False)
        c10d._check_op(dist.isend)
        c10d._check_op(dist.irecv)
        assert getattr(dist.batch_isend_irecv, "__rankscope_wrapped__", False)
    finally:
        rc.close()
        unregister_channel("wrap-p2p")
    assert dist.isend is orig_isend is c10d.isend and dist.irecv is orig_irecv is c10d.irecv


class _HasItsOwnCommHook(torch.nn.Module):
    """Not DDP, but with a ``register_comm_hook`` of another signature (as FSDP1 has)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.hooks: list = []

    def register_comm_hook(self, state, hook):
        self.hooks.append(hook)

    def forward(self, x):
        return self.lin(x)


def test_only_ddp_itself_gets_the_ddp_comm_hook():
    q: queue.Queue = queue.Queue()
    register_channel("wrap-hook", q)
    model = _HasItsOwnCommHook()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="h", sink="embedded://wrap-hook", rank=0, world=1)
    try:
        assert model.hooks == []  # a DDP hook there would raise in its backward
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    finally:
        rc.close()
        unregister_channel("wrap-hook")
    step = [r for r in iter_channel(q) if r.get("type") == "step"]
    assert len(step) == 1 and step[0]["grad_norm"] > 0


def test_a_framework_callback_that_cannot_attach_says_so_and_training_goes_on(caplog):
    """Inside a framework's loop (``collectors/integrations``) a failed attach is a
    WARNING, never an exception into ``fit()`` / ``train()``."""
    from rankscope.collectors.integrations.attachment import Attachment

    model = torch.nn.Linear(4, 1)
    attached = Attachment("cb", "embedded://nowhere", {})
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        attached.start(model, object())  # no torch optimizer in there
    assert attached.rc is None
    assert "not attached" in caplog.text and "training goes on" in caplog.text
    model(torch.ones(2, 4)).sum().backward()  # the model is untouched
    attached.stop()


def _first_steps(model, opt, name, **kw) -> list[int]:
    q: queue.Queue = queue.Queue()
    register_channel(name, q)
    rc = RankCollector.attach(model, opt, job=name, sink=f"embedded://{name}", rank=0, world=1,
                              **kw)  # fmt: skip
    try:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        rc.close()
        unregister_channel(name)
    return [r["step"] for r in iter_channel(q) if r.get("type") == "step"]


def test_a_job_restored_from_a_checkpoint_numbers_its_steps_on_from_there():
    """Steps numbered from 0 again after a restart would be dropped as late by a live
    pipeline that saw the first run's steps; an Adam-family optimizer's restored state
    says how many were taken."""
    model = torch.nn.Linear(4, 1)
    first = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(5):  # the run before the restart
        model(torch.ones(2, 4)).sum().backward()
        first.step()
        first.zero_grad()
    resumed = torch.optim.AdamW(model.parameters(), lr=0.1)
    resumed.load_state_dict(first.state_dict())  # what a checkpoint load does
    assert _first_steps(model, resumed, "resume-adam") == [5, 6]
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert _first_steps(model, fresh, "resume-fresh") == [0, 1]
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # keeps no count: from 0...
    assert _first_steps(model, plain, "resume-sgd") == [0, 1]
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # ...unless the loop says
    assert _first_steps(model, plain, "resume-given", start_step=40) == [40, 41]


def test_a_pipeline_ranks_list_of_stages_is_attached_stage_by_stage():
    """torchtitan hands a pipeline rank's stages over as a list (``model_parts``) with
    one optimizer per part in a container: the schedule calls each stage, never the
    list, so compute starts at the first stage's forward (the time before it is
    input wait), and a restored container counts its parts' steps."""
    import time

    from support.loops.pipeline_interleaved import Optimizers

    q: queue.Queue = queue.Queue()
    register_channel("wrap-parts", q)
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    first = Optimizers(parts, lr=0.1)
    for _ in range(3):  # the run before a restart
        parts[1](parts[0](torch.ones(2, 4))).sum().backward()
        first.step()
        first.zero_grad()
    opt = Optimizers(parts, lr=0.1)
    for mine, saved in zip(opt.optimizers, first.optimizers, strict=True):
        mine.load_state_dict(saved.state_dict())
    rc = RankCollector.attach(parts, opt, job="p", sink="embedded://wrap-parts", rank=0, world=1)
    for _ in range(2):
        time.sleep(0.05)  # the input wait
        parts[1](parts[0](torch.ones(2, 4))).sum().backward()
        opt.step()
        opt.zero_grad()
    rc.close()
    unregister_channel("wrap-parts")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [3, 4] and not rc.faults
    assert all(r["data_s"] >= 0.04 for r in steps[1:]), steps  # the first waits from attach
    with pytest.raises(ValueError, match="RankCollector.attach: model: a list must hold modules"):
        RankCollector.attach([parts[0], "head"], opt, job="p", sink="embedded://x", rank=0,
                             world=1)  # fmt: skip
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        RankCollector.attach({"a": parts[0]}, opt, job="p", sink="embedded://x", rank=0, world=1)

"""The loss read from ``torch.autograd.backward`` where the loop never calls ``rc.loss``
(torchtitan's trainer keeps its loss inside ``train_step``)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from rankscope.collectors import RankCollector
from rankscope.collectors.rank.loss_roots import BackwardRootPatch
from rankscope.collectors.rank.step_state import StepState
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel


def _steps(name: str, loop) -> list[dict]:
    q: queue.Queue = queue.Queue()
    register_channel(name, q)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rc = RankCollector.attach(model, opt, job="lr", sink=f"embedded://{name}", rank=0, world=1)
    try:
        loop(model, opt, rc)
    finally:
        rc.close()
        unregister_channel(name)
    return sorted((r for r in iter_channel(q) if r["type"] == "step"), key=lambda r: r["step"])


def test_the_loss_backpropagated_is_recorded_summed_over_micro_steps():
    x = torch.ones(2, 4)
    seen = []

    def loop(model, opt, rc):
        for step in range(3):
            opt.zero_grad()
            total = 0.0
            for _ in range(2):  # gradient accumulation: each round's loss / 2
                loss = model(x).pow(2).mean() / 2
                total += float(loss.detach())
                loss.backward()
            seen.append(total)
            if step == 2:
                (model(x).sum() * float("nan")).backward()  # a non-finite root is data
            opt.step()

    steps = _steps("loss-roots-sum", loop)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[0]["loss"] == pytest.approx(seen[0], rel=1e-6)
    assert steps[1]["loss"] == pytest.approx(seen[1], rel=1e-6)
    assert steps[2].get("loss") is None and steps[2]["nonfinite_fields"]["loss"] == "NaN"


def test_rc_loss_wins_and_non_scalar_or_given_gradient_roots_are_not_a_loss():
    x = torch.ones(2, 4)

    def loop(model, opt, rc):
        opt.zero_grad()
        model(x).mean().backward()
        opt.step()
        rc.loss(7.0)  # after the step, as the docs allow: it replaces the roots' sum
        opt.zero_grad()
        model(x).backward(torch.ones(2, 1))  # a gradient given: not a loss
        torch.autograd.backward([model(x).sum(), model(x).mean()])  # two roots
        opt.step()
        opt.zero_grad()
        torch.autograd.backward(model(x).sum(), grad_tensors=torch.tensor(2.0))
        opt.step()

    steps = _steps("loss-roots-explicit", loop)
    assert steps[0]["loss"] == 7.0
    assert "loss" not in steps[1] and "loss" not in steps[2]


def test_amp_scaled_roots_are_divided_by_the_scale():
    x = torch.ones(2, 4)
    seen = []

    def loop(model, opt, rc):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for _ in range(2):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            seen.append(float(loss.detach()))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    steps = _steps("loss-roots-amp", loop)
    assert [r["loss"] for r in steps] == pytest.approx(seen, rel=1e-6)


def test_other_threads_and_a_pipeline_dry_run_are_not_the_step():
    st = StepState()
    patch = BackwardRootPatch(st, threading.get_ident(), faults=None)
    patch.install()
    try:
        w = torch.ones(3, requires_grad=True)
        st.dry_run = True
        (w * float("nan")).sum().backward()  # the metadata inference's made-up loss
        st.dry_run = False
        worker = threading.Thread(target=lambda: (w * 2).sum().backward())
        worker.start()
        worker.join()
        assert st.roots == []
        torch.autograd.backward([(w * 3).sum()], grad_tensors=[None])  # a pipeline's last stage
        assert [float(r) for r in st.roots] == [9.0]
    finally:
        patch.uninstall()
    assert torch.autograd.backward is patch._orig


def test_a_partial_or_replicated_dtensor_root_is_its_local_value_a_sharded_one_is_not(tmp_path):
    import torch.distributed as dist
    from rankscope.collectors.rank.loss_roots import _scalar_root
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        part = DTensor.from_local(torch.tensor(2.5, requires_grad=True), mesh, [Partial()])
        rep = DTensor.from_local(torch.tensor(1.5, requires_grad=True), mesh, [Replicate()])
        shard = DTensor.from_local(torch.tensor([4.0], requires_grad=True), mesh, [Shard(0)])
        got = [_scalar_root(t, None) for t in (part, rep, shard)]
        assert [type(g) for g in got[:2]] == [torch.Tensor, torch.Tensor]
        assert [float(g) for g in got[:2]] == [2.5, 1.5] and got[2] is None
    finally:
        dist.destroy_process_group()

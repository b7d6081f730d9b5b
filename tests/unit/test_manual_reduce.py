"""The all-reduce tap of loops that average their gradients themselves."""

from __future__ import annotations

import math

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_fallback import fallback_grad_stats
from rankscope.collectors.rank.manual_reduce import GradAllReduceTap
from rankscope.collectors.rank.step_state import StepState


def _model_after_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model, list(model.parameters())


def test_each_gradient_counted_once_before_its_reduction_and_grad_then_read_as_reduced():
    model, params = _model_after_backward()
    st, faults = StepState(), Faults()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, faults)
    local = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    tap((torch.ones(1),), {}, None)  # a metric the loop reduces: no gradient
    tap((torch.cat([p.grad.view(-1) for p in params[:2]]),), {}, None)  # a bucket: unknown
    for p in params:
        tap((p.grad.data,), {}, None)
        p.grad.data /= 4.0  # what the loop does after SUM
    tap((params[0].grad,), {"group": None}, None)  # reduced twice: counted once
    tap((), {"tensor": params[1].grad}, None)
    assert st.tapped_reductions == len(params) and not faults.counts
    assert math.isclose(math.sqrt(sum(float(n) ** 2 for n in st.local_sq)), local, rel_tol=1e-6)
    assert sum(st.nonfinite) == 0
    st.phase = "optimizer"
    assert fallback_grad_stats(st, params, fsdp=False, dtensor=False)
    assert math.isclose(float(st.reduced_sq[0]), local / 4.0, rel_tol=1e-6)  # not local again
    assert len(st.local_sq) == len(params)


def test_nan_in_a_local_gradient_is_counted_and_the_map_follows_new_gradients():
    model, params = _model_after_backward()
    st = StepState()
    tap = GradAllReduceTap(st, params, Faults())
    st.phase = "forward"  # a metric all-reduced before backward: map built early
    tap((torch.ones(1),), {}, None)
    for p in params:  # set_to_none, then a new backward: new gradient storage
        p.grad = None
    model(torch.randn(5, 4)).square().sum().backward()
    params[1].grad.view(-1)[0] = float("nan")
    st.phase = "backward"
    for p in params:
        tap((p.grad,), {}, None)
    assert st.tapped_reductions == len(params)
    assert sum(int(n) for n in st.nonfinite) == 1
    st.reset_for_next_step(0.0)  # the next step counts every gradient again
    st.phase = "backward"
    for p in params:
        tap((p.grad,), {}, None)
    assert st.tapped_reductions == len(params) and len(st.local_sq) == len(params)


def test_a_flat_copy_of_every_gradient_is_the_local_gradient():
    model, params = _model_after_backward()
    st = StepState()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, Faults())
    flat = torch.cat([p.grad.view(-1) for p in params])
    local = float(torch.linalg.vector_norm(flat))
    tap((flat,), {}, None)
    tap((params[0].grad,), {}, None)  # all counted already
    tap((flat.clone(),), {}, None)
    assert st.tapped_reductions == 1 and math.isclose(float(st.local_sq[0]), local, rel_tol=1e-6)

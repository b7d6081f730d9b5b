"""A pipeline schedule's metadata inference (a real backward on made-up inputs, its
gradients thrown away) is a dry run: the gradient taps read nothing while it runs."""

from __future__ import annotations

import pytest
import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.fsdp import GradInputTap, group_key
from rankscope.collectors.rank.manual_reduce import GradAllReduceTap
from rankscope.collectors.rank.pipeline_infer import PipelineInferencePatch, _stage_classes
from rankscope.collectors.rank.step_state import StepState


class _Stage:
    def __init__(self, state: StepState, seen: list) -> None:
        self.state, self.seen = state, seen

    def _prepare_backward_infra(self, n, fail=False):
        self.seen.append(self.state.dry_run)
        if fail:
            raise RuntimeError("inference failed")
        return n + 1


class _Sub(_Stage):
    def _prepare_backward_infra(self, n, fail=False):  # calls the base: nested
        return super()._prepare_backward_infra(n, fail) + 1


def test_the_inference_is_marked_and_restored_after_it_even_when_it_fails():
    st, seen = StepState(), []
    orig = vars(_Stage)["_prepare_backward_infra"]
    patch = PipelineInferencePatch(st, classes=(_Stage, _Sub))
    patch.install()
    assert _Sub(st, seen)._prepare_backward_infra(1) == 3 and seen == [True]
    assert st.dry_run is False
    with pytest.raises(RuntimeError):
        _Stage(st, seen)._prepare_backward_infra(1, fail=True)
    assert seen == [True, True] and st.dry_run is False
    patch.uninstall()
    assert vars(_Stage)["_prepare_backward_infra"] is orig
    _Stage(st, seen)._prepare_backward_infra(1)
    assert seen[-1] is False


def test_torchs_stage_classes_are_wrapped_and_restored():
    classes = _stage_classes()
    before = {c: vars(c).get("_prepare_backward_infra") for c in classes}
    if not any(before.values()):
        pytest.skip("this torch's pipelining has no metadata inference")
    patch = PipelineInferencePatch(StepState())
    patch.install()
    wrapped = [c for c in classes if getattr(vars(c).get("_prepare_backward_infra"),
                                              "__rankscope_wrapped__", False)]  # fmt: skip
    assert wrapped == [c for c in classes if before[c] is not None]
    patch.uninstall()
    assert {c: vars(c).get("_prepare_backward_infra") for c in classes} == before


def test_the_taps_read_no_gradient_in_a_dry_run():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    params = list(model.parameters())
    st = StepState()
    st.phase = "backward"
    manual = GradAllReduceTap(st, params, Faults())

    class _Group:  # what group_key reads of a process group
        group_name = "g"

    fsdp = GradInputTap(st, {group_key(_Group()): object()}, Faults())
    st.dry_run = True
    manual((params[0].grad,), {}, None)
    fsdp((), {"input": torch.full((4,), float("nan"))}, _Group())
    assert st.local_sq == [] and st.nonfinite == [] and st.tapped_reductions == 0
    st.dry_run = False
    manual((params[0].grad,), {}, None)
    fsdp((), {"input": torch.ones(4)}, _Group())
    assert len(st.local_sq) == 2 and st.tapped_reductions == 2

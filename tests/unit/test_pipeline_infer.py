"""A pipeline schedule's metadata inference (a real backward on made-up inputs, its
gradients thrown away) is a dry run: the gradient taps read nothing while it runs."""

from __future__ import annotations

import threading

import pytest
import torch
from rankscope.collectors.rank.dist_wrap import DistPatch
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


def test_no_tap_reads_a_gradient_in_a_dry_run():
    """``dist_wrap`` records the call but calls no tap while the inference runs."""
    st, seen = StepState(), []
    patch = DistPatch(st, lambda g: "world", threading.get_ident(),
                      taps={"all_reduce": lambda a, k, g: seen.append(a[0])})  # fmt: skip
    patch._active = True

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = patch._wrap("all_reduce", "allreduce", all_reduce)
    st.dry_run = True
    wrapped(torch.full((4,), float("nan")))
    assert seen == [] and [c["op"] for c in st.collectives] == ["allreduce"]
    st.dry_run = False
    wrapped(torch.ones(4))
    assert len(seen) == 1 and len(st.collectives) == 2

"""Loops that all-reduce their gradients themselves (no DDP, no FSDP).

PyTorch's "Writing Distributed Applications" tutorial and much research code
average gradients with one ``dist.all_reduce`` per parameter after
``backward()``. By the optimizer step ``.grad`` holds the average, so what
this rank computed (``grad_norm``, and ``nonfinite``: the evidence of where a
NaN came from) exists only just before each call. This tap sees every
``all_reduce``; a tensor sharing a parameter's gradient storage is counted
into the local norm once per step, and ``.grad`` at the optimizer step is then
the reduced gradient (``grad_norm_reduced``, ``grad_fallback.py``; or the
loop's own clipping norm, when it clipped after the reductions). Once
backward is over, the first such call reads every gradient in one pass; a
loop reducing from inside backward (a hook per gradient) has each read alone.

A loop that first copies all its gradients into one flat buffer (apex's and
older codebases' ``_flatten_dense_tensors``) is recognized by the size: a
buffer holding exactly as many elements as every gradient together, reduced
before any single gradient. A bucket that is a slice of a flat buffer the
gradients are views of (Megatron-LM's grad buffer and its ``main_grad``
views, a hand-rolled bucket laid out the same way) is recognized by the
storage: the gradients whose bytes lie inside the reduced slice are read as
that one tensor. A bucket COPIED out of some gradients (fairseq's legacy
``all_reduce_and_rescale_tensors``) is recognized by the size, as the whole
flat copy is: gradients not reduced yet, consecutive in parameter
order or its reverse, as many elements as it, reduced after forward and
before the optimizer step (a copy of one gradient from 64 elements). A copy
in another order is not: ``grad_norm`` is then ``.grad``'s, the reduced one.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_stats import grad_of, grads_norm_stats, tensor_norm_stats
from rankscope.collectors.rank.step_state import StepState

__all__ = ["GradAllReduceTap"]

MIN_LONE_COPY = 64  # elements of a copy of ONE gradient taken for a bucket of it
_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside autograd's run


def _backward_over() -> bool:
    """Whether this call is outside a backward pass (unknown where torch cannot say)."""
    return _TASK_ID is not None and _TASK_ID() < 0


class GradAllReduceTap:
    """``dist_wrap`` tap for ``all_reduce``: the local norm of each gradient the loop
    reduces, read just before its call (training thread)."""

    def __init__(
        self, state: StepState, params: list[torch.Tensor], faults: Faults, self_time: Any = None
    ) -> None:
        self._state = state
        self._params = params
        self._faults = faults
        self._self_time = self_time  # SelfTime: the pass counts as grad_norm_s
        self._ptrs: dict[int, int] = {}  # gradient storage -> parameter index
        self._key: tuple[int, bool] = (-1, False)  # (step, built in backward) of _ptrs
        self._total = -1  # elements of every gradient together (-1: none yet)
        self._done: set[int] = set()  # parameters whose reduction was seen this step
        self._batched = False  # this step's first reduction read every gradient
        # the gradients that batch read, not reduced yet: storage -> (parameter, size)
        self._rest: dict[int, tuple[int, int]] = {}
        self._rest_step = -1
        # gradient storage -> [(first byte, end byte, parameter)]; built on a miss
        self._spans: dict[int, list[tuple[int, int, int]]] | None = None

    def __call__(self, args: tuple, kwargs: dict, group: Any) -> None:
        try:
            t = kwargs.get("tensor", args[0] if args else None)
            if self._rest and self._rest_step == self._state.step and isinstance(t, torch.Tensor):
                hit = self._rest.pop(t.data_ptr(), None)  # read with the others already
                if hit is not None and hit[1] == t.numel():
                    self._done.add(hit[0])
                    self._state.tapped_reductions += 1
                    return
                if hit is not None:  # the storage's start, not the gradient: judged below
                    self._rest[t.data_ptr()] = hit
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                return
            idx = self._param_of(t)
            covered = self._covered(t) if idx is None else None
            if covered:  # a slice of the buffer the gradients are views of: a bucket
                if covered <= self._done:  # read with the others already
                    self._state.tapped_reductions += 1
                    return
                self._done.update(covered)
                grads = [t]
            elif idx is None and not self._done and t.numel() == self._total:
                self._done.update(range(len(self._params)))  # a flat copy of them all
                grads = [t]
            elif idx is None and (run := self._copied_run(t)):  # a copy of some of them
                self._done.update(run)
                if self._batched:  # read with the others at the first reduction
                    self._state.tapped_reductions += 1
                    return
                grads = [t]
            elif idx is None or idx in self._done:
                return
            elif self._batched:  # read with the others at the first reduction
                self._done.add(idx)
                self._state.tapped_reductions += 1
                return
            elif not self._done and _backward_over():
                # backward is over, so every gradient is still this rank's own: one pass
                # over them all (28 calls of a small LM's cost 5x more on a crowded host)
                self._done.add(idx)
                self._batched = True
                grads = [grad_of(self._params[i]) for i in self._ptrs.values()]
                self._rest = {ptr: (i, grad_of(self._params[i]).numel())
                              for ptr, i in self._ptrs.items() if i != idx}  # fmt: skip
                self._rest_step = self._state.step
            else:  # reduced from inside backward (a hook per gradient): this one alone
                self._done.add(idx)
                grads = [t]
            t0 = time.perf_counter()
            one = len(grads) == 1
            norm, nonfinite = tensor_norm_stats(grads[0]) if one else grads_norm_stats(grads)
            st = self._state
            st.local_sq.append(norm)
            st.nonfinite.append(nonfinite)
            st.local_scaled = True  # taken during backward, under AMP's loss scale
            st.tapped_reductions += 1
            if self._self_time is not None:
                self._self_time.grad_norm_s += time.perf_counter() - t0
        except Exception as exc:
            self._faults.hit("grad_norm (all-reduce input)", exc)

    def _param_of(self, t: torch.Tensor) -> int | None:
        """The parameter whose gradient ``t`` is (same storage and size), if any. The
        map is rebuilt once a step, again once backward has made the gradients (a loop
        may all-reduce a metric before its backward), and on a miss while some
        gradients were missing from it (reduced one by one as backward makes them)."""
        st = self._state
        in_backward = st.phase == "backward"
        step, built_in_backward = self._key
        if step != st.step or (in_backward and not built_in_backward):
            if step != st.step:
                self._done.clear()
                self._batched = False
            self._build(in_backward)
        idx = self._ptrs.get(t.data_ptr())
        if idx is None and in_backward and len(self._ptrs) < len(self._params):
            self._build(in_backward)
            idx = self._ptrs.get(t.data_ptr())
        g = None if idx is None else grad_of(self._params[idx])
        return idx if g is not None and g.numel() == t.numel() else None

    def _covered(self, t: torch.Tensor) -> set[int] | None:
        """The parameters whose gradients lie inside contiguous ``t``'s bytes of the
        same storage (``t`` a bucket of a flat gradient buffer), if any."""
        if not t.is_contiguous():
            return None
        if self._spans is None:
            self._spans = {}
            for i in self._ptrs.values():
                g = grad_of(self._params[i])
                if g.is_contiguous():
                    a = g.storage_offset() * g.element_size()
                    span = (a, a + g.numel() * g.element_size(), i)
                    self._spans.setdefault(g.untyped_storage().data_ptr(), []).append(span)
        spans = self._spans.get(t.untyped_storage().data_ptr())
        if not spans:
            return None
        a = t.storage_offset() * t.element_size()
        b = a + t.numel() * t.element_size()
        return {i for start, end, i in spans if a <= start and end <= b} or None

    def _copied_run(self, t: torch.Tensor) -> set[int] | None:
        """Gradients not reduced yet, consecutive in parameter order (or its reverse),
        whose sizes add up to ``t``'s: a bucket the loop copied them into (fairseq's
        legacy ``all_reduce_and_rescale_tensors`` fills one buffer in order). Only
        between forward and the optimizer step, same dtype; one gradient alone only
        from ``MIN_LONE_COPY`` elements (a loop's metrics are a few numbers)."""
        if self._state.phase != "backward" or t.numel() < 2:
            return None
        pending = [i for i in sorted(self._ptrs.values()) if i not in self._done]
        for order in (pending, pending[::-1]):
            total = 0
            for k, i in enumerate(order):
                g = grad_of(self._params[i])
                total += g.numel()
                if g.dtype != t.dtype or total > t.numel():
                    break
                if total == t.numel():
                    if k >= 1 or total >= MIN_LONE_COPY:
                        return set(order[: k + 1])
                    break
        return None

    def _build(self, in_backward: bool) -> None:
        grads = ((i, grad_of(p)) for i, p in enumerate(self._params))
        self._ptrs = {
            g.data_ptr(): i for i, g in grads if g is not None and g.layout == torch.strided
        }
        self._spans = None
        self._key = (self._state.step, in_backward)
        self._total = sum(grad_of(self._params[i]).numel() for i in self._ptrs.values()) or -1

"""Megatron-LM's data parallel, in small: no torch DDP, a gradient buffer of its own.

``megatron``: the nanoGPT model and step (``fa_loops.py``) under the shape of
Megatron-LM's ``DistributedDataParallel`` and fp32 optimizer. Every parameter
gets ``main_grad``, an fp32 view into one flat buffer; a hook after each
gradient's accumulation adds ``.grad`` into ``main_grad`` and frees ``.grad``.
The buffer is cut into buckets (parameters in reverse order, as backward
makes them); on the last micro-batch each bucket, once all its gradients are
in, is scaled by 1/world and all-reduced asynchronously from inside backward,
and the loop waits for them all after backward. The optimizer then sees
``param.grad = param.main_grad``, and the buffer is zeroed for the next step.

There is no DDP bucket and no ``.grad`` during the reductions: the collector
reads each bucket as a slice of the buffer the ``main_grad`` views share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradBuffer", "megatron_loop"]


class GradBuffer:
    """The flat buffer, its buckets and the hooks that fill and launch them."""

    def __init__(self, model: torch.nn.Module, bucket_elements: int) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        self.buckets: list[tuple[int, int, int]] = []  # (first, end, parameters)
        self.bucket_of: dict[torch.nn.Parameter, int] = {}
        offset, start, members = 0, 0, []
        for p in reversed(params):  # backward makes the last layers' gradients first
            p.main_grad = self.data[offset : offset + p.numel()].view_as(p)
            members.append(p)
            offset += p.numel()
            if offset - start >= bucket_elements or p is params[0]:
                for q in members:
                    self.bucket_of[q] = len(self.buckets)
                self.buckets.append((start, offset, len(members)))
                start, members = offset, []
        self.sync = True
        self.ready: list[int] = []
        self.handles: list[Any] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if not self.sync:
            return
        b = self.bucket_of[p]
        self.ready[b] += 1
        start, end, members = self.buckets[b]
        if self.ready[b] == members:
            view = self.data[start:end]
            view.mul_(1.0 / dist.get_world_size())
            self.handles.append(dist.all_reduce(view, async_op=True))

    def start(self, sync: bool) -> None:
        """Before a micro-batch's backward: reduce on this one (the last) or not."""
        self.sync, self.ready, self.handles = sync, [0] * len(self.buckets), []

    def finish(self) -> None:
        """After the last backward: wait for the buckets, hand the optimizer main_grad."""
        for h in self.handles:
            h.wait()
        for p in self.params:
            p.grad = p.main_grad

    def zero(self) -> None:
        for p in self.params:
            p.grad = None
        self.data.zero_()


def megatron_loop(base: type) -> type:
    """The ``megatron`` loop on nanoGPT's loop class ``base`` (passed in: ``fa_loops``
    imports this module)."""

    class MegatronLoop(base):
        style = "megatron"
        ddp = False  # no comm hook; the reductions are the loop's own
        nan_in_grad = True  # a gradient hook poisons .grad before it joins main_grad
        reduce_op = "all_reduce"
        faults = ("straggler", "sdc-param", "nonfinite")

        def wrap(self) -> torch.nn.Module:
            self.buffer = GradBuffer(self.model, bucket_elements=40_000)
            self.make_optimizer(self.model)
            return self.model

        def step(self, it: int, rc) -> None:
            for g in self.opt.param_groups:
                g["lr"] = self._lr(it)
            for micro in range(self.accum):
                x, y = self._batch()
                self.buffer.start(sync=micro == self.accum - 1)
                loss = self.model(x, y) / self.accum
                loss.backward()
            self.buffer.finish()
            self._update()
            self.buffer.zero()
            self.last_loss = loss.detach()
            rc.loss(loss.detach() * self.accum)

    return MegatronLoop

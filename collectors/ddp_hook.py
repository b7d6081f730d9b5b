"""The DDP communication hook the collector registers, wrapping the user's.

DDP overlaps the gradient all-reduce with backward, so by the time
``backward()`` returns every gradient is already the reduced one. The only
place to see this rank's LOCAL gradient is the bucket handed to the
communication hook, before it is reduced: that is where ``grad_norm`` and
``nonfinite`` come from. The reduced bucket (what the hook's future yields)
gives ``grad_norm_reduced``, computed on the completing comm thread.

The local statistics are taken from the bucket as DDP hands it over, BEFORE
the user's hook runs; a fault that corrupts a local gradient should do so
earlier, in a gradient hook (``param.register_hook``), which runs before DDP
copies the gradient into its bucket. A user hook that delays or corrupts
the reduction (a slow link, a bad reduce) is seen in the timings and in
``grad_norm_reduced``.

Timing: the hook's own duration on the calling thread counts as ``comm_s``
(launching, or a deliberate delay inside the user hook). After the last
bucket is launched backward has nothing left to compute and DDP's
finalization waits for the outstanding reductions; that wait, from the last
launch returning to the last reduction completing, counts as ``comm_s`` too
(``StepState.backward_wait_s``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from collectors.step_state import StepState

__all__ = ["HookContext", "make_ddp_hook", "tensor_norm_stats", "hook_context"]

log = logging.getLogger("rankscope.collectors")

# Set while the collector's DDP hook runs on this thread, so that the patched
# torch.distributed functions know a call is the bucket's own reduction and
# do not record it a second time.
hook_context = threading.local()


class HookContext:
    """Settings the hook closure reads; swapped to pass-through at close."""

    __slots__ = ("state", "group_name", "user_hook", "user_state", "process_group", "active", "_pg")

    def __init__(
        self,
        state: StepState,
        group_name: str,
        user_hook: Callable | None,
        user_state: Any,
        process_group: Any,
    ) -> None:
        self.state = state
        self.group_name = group_name
        self.user_hook = user_hook
        self.user_state = user_state
        self.process_group = process_group
        self.active = True
        self._pg: tuple[Any, int] | None = None

    def group_and_size(self) -> tuple[Any, int]:
        """The reducing process group and its size, looked up once."""
        if self._pg is None:
            import torch.distributed as dist

            group = self.process_group if self.process_group is not None else dist.group.WORLD
            self._pg = (group, group.size())
        return self._pg


def tensor_norm_stats(t: torch.Tensor) -> tuple[Any, Any]:
    """(L2 norm, nonfinite count) of ``t``; on accelerators both stay lazy tensors.

    On CPU the norm is taken in the tensor's own precision (float32 at least),
    which is one vectorized pass; only when that is not finite is it taken
    again accumulating in float64 (an exponent bit flip, ~1e34, squared
    overflows float32 and would turn the very value that shows the corruption
    into inf) and, if still not finite, the nonfinite elements counted. The
    common case is therefore one cheap pass.
    """
    if t.numel() == 0:
        return 0.0, 0
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype in (torch.float32, torch.float64):
            value = float(torch.linalg.vector_norm(t))
        else:
            value = float(torch.linalg.vector_norm(t, dtype=torch.float32))
        if math.isfinite(value):
            return value, 0
        value = float(torch.linalg.vector_norm(t, dtype=torch.float64))
        if math.isfinite(value):
            return value, 0
        return value, int((~torch.isfinite(t)).sum())
    norm = torch.linalg.vector_norm(t, dtype=torch.float64)
    return norm, (~torch.isfinite(t)).sum()


def _launch_average(ctx: HookContext, bucket: Any) -> torch.futures.Future:
    """DDP's default reduction (divide by the group size, all-reduce) launched on
    the process group directly: no pass through the ``torch.distributed``
    Python wrappers (nor the collector's own patch of them), and the raw
    future back, so the collector's completion callback is the only Python
    hop on the comm thread (``default_hooks.allreduce_hook`` adds another)."""
    group, size = ctx.group_and_size()
    buf = bucket.buffer()
    if size > 1:  # a pass over the bucket that plain DDP fuses into its copy (docs/collectors.md)
        buf.div_(size)
    return group.allreduce([buf]).get_future()


def make_ddp_hook(ctx: HookContext) -> Callable:
    """A DDP comm hook (``hook(state, bucket)``) that measures, then reduces via the user's hook."""

    def rankscope_comm_hook(state, bucket):  # no annotations: DDP inspects them
        if not ctx.active:
            return _reduce(bucket)
        st = ctx.state
        entry = None
        try:
            buf = bucket.buffer()
            norm, nonfinite = tensor_norm_stats(buf)
            st.local_sq.append(norm)
            st.nonfinite.append(nonfinite)
            entry = st.enter_collective(
                "allreduce", ctx.group_name, buf.numel() * buf.element_size()
            )
            st.buckets += 1
        except Exception as exc:
            log.debug("comm hook bookkeeping failed: %s", exc)
        t_enter = time.perf_counter()
        try:
            if ctx.user_hook is None:
                fut = _launch_average(ctx, bucket)
            else:
                hook_context.active = True
                fut = _reduce(bucket)
        finally:
            hook_context.active = False
            t_exit = time.perf_counter()
            st.comm_s += t_exit - t_enter
            st.last_launch_exit_perf = t_exit
            last = st.buckets_prev_step and st.buckets >= st.buckets_prev_step
            if last and st.buckets_done < st.buckets:
                st.phase = "collective"  # last bucket launched: backward now waits
        if entry is None:
            return fut

        def done(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            if ctx.user_hook is None:
                value = value[0]  # the all-reduce future yields [tensor]
            try:
                now = time.perf_counter()
                st.last_done_perf = (
                    now if st.last_done_perf is None else max(now, st.last_done_perf)
                )
                st.finish_collective(entry, now - t_enter)
                st.buckets_done += 1
                if st.phase == "collective" and st.buckets_done >= st.buckets:
                    st.phase = "optimizer"  # backward is released: clip, step...
                reduced = value[0] if isinstance(value, (list, tuple)) else value
                st.reduced_sq.append(tensor_norm_stats(reduced)[0])
            except Exception as exc:
                log.debug("comm hook completion bookkeeping failed: %s", exc)
            return value

        return fut.then(done)

    def _reduce(bucket) -> torch.futures.Future:
        if ctx.user_hook is not None:
            return ctx.user_hook(ctx.user_state, bucket)
        return _launch_average(ctx, bucket).then(lambda f: f.value()[0])

    return rankscope_comm_hook

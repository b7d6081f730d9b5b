"""The DDP communication hook the collector registers, wrapping the user's.

DDP overlaps the gradient all-reduce with backward, so by the time
``backward()`` returns every gradient is already the reduced one. The only
place to see this rank's LOCAL gradient is the bucket handed to the
communication hook, before it is reduced: that is where ``grad_norm`` and
``nonfinite`` come from. The reduced bucket (what the hook's future yields)
gives ``grad_norm_reduced``, computed on the completing comm thread, unless
the loop clips gradients: then the clipping's norm is that value and the
pass is skipped (``collectors/rank/clip_patch.py``).

The local statistics are taken from the bucket as DDP hands it over, BEFORE
the user's hook runs; a fault that corrupts a local gradient should do so
earlier, in a gradient hook (``param.register_hook``), which runs before DDP
copies the gradient into its bucket. A user hook that delays or corrupts
the reduction (a slow link, a bad reduce) is seen in the timings and in
``grad_norm_reduced``.

Gradient accumulation without ``no_sync`` reduces every micro-step; a later
round's bucket then holds the earlier rounds' reduced sum, so a NaN one rank
made in the first micro-step is in every rank's next bucket. A round whose
earlier reduction was already non-finite counts nothing as this rank's own
(``_own_part``).

Timing: the hook's own duration on the calling thread counts as ``comm_s``
(launching, or a deliberate delay inside the user hook). After the last
bucket is launched backward has nothing left to compute and DDP's
finalization waits for the outstanding reductions; that wait, from the last
launch returning to the last reduction completing, counts as ``comm_s`` too
(``StepState.backward_wait_s``). On CUDA the same tail is also timed on the
device, from an event at each launch to one in each completion callback
(``device_timing.py``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from rankscope.collectors.rank.grad_stats import tensor_norm_stats
from rankscope.collectors.rank.self_time import SelfTime
from rankscope.collectors.rank.step_state import StepState

__all__ = ["HookContext", "hook_context", "install_ddp_hook", "make_ddp_hook"]

log = logging.getLogger("rankscope.collectors")

# Set while the collector's DDP hook runs on this thread, so that the patched
# torch.distributed functions know a call is the bucket's own reduction and
# do not record it a second time.
class _InHook(threading.local):
    active = False  # a class default: no exception to catch on a thread that never set it


hook_context = _InHook()


class HookContext:
    """Settings the hook closure reads; swapped to pass-through at close."""

    __slots__ = (
        "state",
        "group_name",
        "user_hook",
        "user_state",
        "process_group",
        "active",
        "self_time",
        "timing",
        "_pg",
    )

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
        self.self_time = SelfTime()  # the collector's, shared when attached
        self.timing: Any = None  # device_timing.DeviceTiming on CUDA (the tail's events)
        self._pg: tuple[Any, int] | None = None

    def group_and_size(self) -> tuple[Any, int]:
        """The reducing process group and its size, looked up once."""
        if self._pg is None:
            import torch.distributed as dist

            group = self.process_group if self.process_group is not None else dist.group.WORLD
            self._pg = (group, group.size())
        return self._pg


_NUMPY_SCALED = (torch.float32, torch.float64)


def _launch_average(ctx: HookContext, buf: torch.Tensor) -> tuple[torch.futures.Future, float]:
    """DDP's default reduction (the bucket times 1/group size, summed over the
    group) launched on the process group directly: no pass through the
    ``torch.distributed`` Python wrappers (nor the collector's own patch of
    them), and the raw future back, so that the collector's completion
    callback is the only Python hop on the comm thread.

    The bucket is scaled BEFORE the reduction with the very reciprocal plain
    DDP multiplies by while it copies gradients into its buckets, so the
    result is bit for bit plain DDP's. That matters beyond reproducibility:
    ranks without the collector (attached on some ranks only) or with
    ``default_hooks.allreduce_hook`` scale first too, and a rank that scaled
    after the sum would silently corrupt every rank's gradient. The price is
    one pass over the bucket that plain DDP fuses into its copy
    (docs/collectors.md), made in numpy for CPU float buckets (same float32
    or float64 products, less dispatch). Also returns the seconds the launch
    itself took.
    """
    group, size = ctx.group_and_size()
    if size > 1:
        if buf.device.type == "cpu" and buf.dtype in _NUMPY_SCALED:
            flat = buf.numpy()
            np.multiply(flat, 1.0 / size, out=flat)
        else:
            buf.mul_(1.0 / size)
    t0 = time.perf_counter()
    fut = group.allreduce([buf]).get_future()
    return fut, time.perf_counter() - t0


def _first_tensor(value: Any) -> torch.Tensor:
    """The reduced bucket out of what a reduction's future yields ([tensor] or tensor)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _own_part(norm: Any, nonfinite: Any, reduced: Any) -> tuple[Any, Any]:
    """This rank's part of a bucket reduced again in the same step (gradient
    accumulation without ``no_sync``): the bucket holds the earlier rounds'
    reduced sum plus this micro-step's gradient. Where that sum was already
    non-finite, every rank's bucket is, whoever's NaN it was: the round adds
    nothing to this rank's own count (the NaN's origin is the round it first
    appeared in). ``reduced``: the earlier round's reduced norm (None: not read)."""
    if reduced is None:
        return norm, nonfinite
    if isinstance(reduced, torch.Tensor):  # an accelerator's lazy norm: stay lazy
        ok = torch.isfinite(reduced)
        return torch.where(ok, norm, torch.zeros_like(norm)), nonfinite * ok
    return (norm, nonfinite) if math.isfinite(reduced) else (0.0, 0)


def make_ddp_hook(ctx: HookContext) -> Callable:
    """A DDP comm hook (``hook(state, bucket)``) that measures, then reduces via the user's hook."""

    def rankscope_comm_hook(state, bucket):  # no annotations: DDP inspects them
        if not ctx.active or ctx.state.dry_run:  # dry run: a pipeline's made-up gradients
            return _reduce(bucket)
        t_start = time.perf_counter()
        st = ctx.state
        entry = None
        norm_s = launch_s = 0.0
        buf = bucket.buffer()
        idx = -1
        try:
            t_norm = time.perf_counter()
            norm, nonfinite = tensor_norm_stats(buf)
            idx = bucket.index()
            rounds = st.bucket_rounds.get(idx, 0)
            st.bucket_rounds[idx] = rounds + 1
            if rounds:  # a later micro-step's reduction of this step's bucket
                norm, nonfinite = _own_part(norm, nonfinite, st.reduced_by_bucket.get(idx))
            norm_s = time.perf_counter() - t_norm
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
                fut, launch_s = _launch_average(ctx, buf)
            else:
                hook_context.active = True
                fut = ctx.user_hook(ctx.user_state, bucket)
        finally:
            hook_context.active = False
            t_exit = time.perf_counter()
            if ctx.user_hook is not None:
                launch_s = t_exit - t_enter  # the user's reduction is not the collector's cost
            st.comm_s += t_exit - t_enter
            st.last_launch_exit_perf = t_exit
            if ctx.timing is not None:
                ctx.timing.bucket_launched()
            last = st.buckets_prev_step and st.buckets >= st.buckets_prev_step
            if last and st.buckets_done < st.buckets:
                st.phase = "collective"  # last bucket launched: backward now waits

        def done(f: torch.futures.Future) -> torch.Tensor:
            reduced = _first_tensor(f.value())
            if entry is None:
                return reduced
            try:
                now = time.perf_counter()
                last_done = st.last_done_perf
                st.last_done_perf = now if last_done is None or now > last_done else last_done
                st.finish_collective(entry, now - t_enter)
                st.buckets_done += 1
                if ctx.timing is not None:
                    ctx.timing.bucket_done()  # on the stream that waits for the reduction
                if st.phase == "collective" and st.buckets_done >= st.buckets:
                    st.phase = "optimizer"  # backward is released: clip, step...
                if not st.clip_seen or st.accumulating:
                    rnorm = tensor_norm_stats(reduced)[0]
                    st.reduced_by_bucket[idx] = rnorm
                    if not st.clip_seen:  # else the loop's clip_grad_norm_ gives it
                        st.reduced_sq.append(rnorm)
            except Exception as exc:
                log.debug("comm hook completion bookkeeping failed: %s", exc)
            return reduced

        if entry is not None or ctx.user_hook is None:
            fut = fut.then(done)
        spent = ctx.self_time
        spent.grad_norm_s += norm_s
        spent.launch_s += launch_s
        spent.comm_hook_s += time.perf_counter() - t_start - norm_s - launch_s
        return fut

    def _reduce(bucket) -> torch.futures.Future:
        if ctx.user_hook is not None:
            return ctx.user_hook(ctx.user_state, bucket)
        return _launch_average(ctx, bucket.buffer())[0].then(lambda f: _first_tensor(f.value()))

    return rankscope_comm_hook


def install_ddp_hook(ddp_model: Any, ctx: HookContext) -> bool:
    """Register the collector's hook on ``ddp_model``; False, said at WARNING, where
    DDP refuses it. DDP takes one hook for good: one registered before attach
    (Lightning's ``ddp_comm_hook``, Accelerate's ``comm_hook``) keeps the reduction,
    and the records carry ``grad_norm_reduced`` from ``.grad`` and no local norm."""
    try:
        ddp_model.register_comm_hook(None, make_ddp_hook(ctx))
        return True
    except RuntimeError as exc:
        log.warning(
            "rankscope collector: DDP took no communication hook (%s): the local gradient "
            "is not seen, grad_norm and nonfinite are left out and grad_norm_reduced is read "
            "from .grad at the optimizer step; to keep them, hand your hook to "
            "RankCollector.attach(comm_hook=..., comm_state=...) instead of DDP",
            exc,
        )
        return False

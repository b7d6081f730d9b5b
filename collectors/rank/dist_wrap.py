"""Timing the ``torch.distributed`` collectives a training loop calls itself.

At attach the collector replaces the collective functions in the
``torch.distributed`` namespace with thin wrappers and restores them at close
(only where nobody replaced them again since). A wrapper records op, group,
per-group sequence number, bytes and seconds inside the call, counts the
seconds as ``comm_s`` when the call is synchronous on the training thread,
and sets the beat phase to ``collective`` while inside. Calls made by the
collector's own DDP hook pass straight through. Any failure of the
bookkeeping is swallowed; the collective's own result or exception is what
the caller gets.

The wrapped names cover what loops and wrappers call: the classic ones, the
``*_single`` ones FSDP2 calls (``all_gather_single``, ``reduce_scatter_single``),
the coalesced ones, and point-to-point ops (pipeline schedules: ``isend``/``irecv``
are replaced in ``distributed_c10d`` too, where ``P2POp`` checks an op's
identity). ``taps`` are
callbacks that see a call's arguments just before it runs (FSDP2's local
gradient norm is taken from its reduce-scatter input there). While
``torch.compile`` traces, a wrapper passes straight through.

Asynchronous calls (``async_op=True``, ``batch_isend_irecv``) are recorded at
launch; the training thread's later ``Work.wait()`` on them is timed into
``comm_s`` and the entry's ``s`` (``work_wait.py``). On CUDA, synchronous calls
are bracketed with timing events (``device_timing.py``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from rankscope.collectors.rank.by_name import rebind, restore
from rankscope.collectors.rank.ddp_hook import hook_context
from rankscope.collectors.rank.fsdp import group_key
from rankscope.collectors.rank.step_state import StepState

__all__ = ["DistPatch", "OP_NAMES", "group_label"]

log = logging.getLogger("rankscope.collectors")

OP_NAMES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "all_gather_into_tensor": "allgather",
    "all_gather_object": "allgather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "reduce": "reduce",
    "barrier": "barrier",
    "all_to_all": "alltoall",
    "all_to_all_single": "alltoall",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
    # FSDP2 (torch >= 2.9 names) and the coalesced forms
    "all_gather_single": "allgather",
    "reduce_scatter_single": "reduce_scatter",
    "all_reduce_coalesced": "allreduce",
    "all_gather_coalesced": "allgather",
    # point to point (torch.distributed.pipelining calls isend/irecv itself for
    # one-way batches, batch_isend_irecv for mixed ones)
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
    "batch_isend_irecv": "p2p",
}
# Also replaced in distributed_c10d itself: P2POp and batch_isend_irecv check an op's
# identity against that module's isend/irecv, so both names must be the wrapper
_C10D_TOO = ("isend", "irecv")
# DDP broadcasts its module buffers from rank 0 before each forward (a model with
# a registered buffer, e.g. a causal mask) through ``dist._broadcast_coalesced``,
# which no public name reaches: the DDP instance's method is wrapped instead.
_DDP_BUFFER_SYNC = "_distributed_broadcast_coalesced"
_INPUT_KWARGS = ("tensor", "input", "input_tensor", "tensor_list", "tensors", "p2p_op_list")


class _Busy(threading.local):
    on = False  # inside the original call on this thread: nested calls pass through


def _nbytes(obj: Any) -> int | None:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return sum(t.numel() * t.element_size() for t in obj)
    if isinstance(obj, (list, tuple)) and obj and all(hasattr(o, "tensor") for o in obj):
        return _nbytes([o.tensor for o in obj])  # P2POp list
    return None


def _call_bytes(args: tuple, kwargs: dict) -> int | None:
    if args:
        return _nbytes(args[0])
    for k in _INPUT_KWARGS:
        if k in kwargs:
            return _nbytes(kwargs[k])
    return None


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def group_label(group: Any, known: dict[int, str]) -> str:
    """The name a collective's process group is recorded under: the topology's name
    for it when known, ``world`` for the default group, else its own name."""
    if group is None:
        return "world"
    name = known.get(id(group))
    if name:
        return name
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD:
            return "world"
    except Exception:
        pass
    return str(getattr(group, "group_name", None) or f"pg{id(group):x}")


class DistPatch:
    """Installs and removes the wrappers for one collector."""

    def __init__(
        self,
        state: StepState,
        group_name: Callable[[Any], str],
        training_thread: int,
        taps: dict[str, Callable] | None = None,
        faults: Any = None,
        works: Any = None,
        timing: Any = None,
        ddp: tuple[Any, str] | None = None,
        foreign_hook_group: Any = None,
        self_time: Any = None,
    ) -> None:
        self._state = state
        self._self_time = self_time  # SelfTime: the wrappers' bookkeeping, collectives_s
        # DDP's process group where a hook of the user's own (registered before attach)
        # reduces the gradients: its async all-reduces are timed to their completion
        self._foreign = foreign_hook_group
        self._ddp = ddp  # (the DDP module, its gradient group's name): buffer broadcasts
        self._works = works  # work_wait.WorkWaitPatch: times the async calls' waits
        self._timing = timing  # device_timing.DeviceTiming on CUDA
        self._taps = dict(taps or {})
        self._faults = faults
        self._group_name = group_name
        self._training_thread = training_thread
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._busy = _Busy()
        self._active = False
        self._rebound: list = []  # by_name.rebind: modules that imported a function by name

    def install(self) -> None:
        import torch.distributed as dist

        self._active = True
        for name, op in OP_NAMES.items():
            orig = getattr(dist, name, None)
            if orig is None or not callable(orig):
                continue
            wrapper = self._wrap(name, op, orig)
            self._originals[name] = orig
            self._wrappers[name] = wrapper
            setattr(dist, name, wrapper)
            if name in _C10D_TOO and getattr(dist.distributed_c10d, name, None) is orig:
                setattr(dist.distributed_c10d, name, wrapper)
        self._rebound = rebind(self._originals, self._wrappers)
        self._install_ddp_buffer_sync()

    def _install_ddp_buffer_sync(self) -> None:
        """Time DDP's buffer broadcast: rank 0 waits there for a late peer, and that
        wait would otherwise count as rank 0's compute (a slow link elsewhere would
        make rank 0 look like a straggler)."""
        if self._ddp is None:
            return
        module, label = self._ddp
        orig = getattr(module, _DDP_BUFFER_SYNC, None)
        if not callable(orig):
            return
        wrapper = self._wrap(_DDP_BUFFER_SYNC, "broadcast", orig, label=label)
        setattr(module, _DDP_BUFFER_SYNC, wrapper)  # on the instance: other DDPs untouched
        self._wrappers[_DDP_BUFFER_SYNC] = wrapper

    def uninstall(self) -> None:
        """Restore the originals; a wrapper someone else wrapped again stays in
        place but passes straight through from now on."""
        import torch.distributed as dist

        self._active = False
        ddp_sync = self._wrappers.pop(_DDP_BUFFER_SYNC, None)
        if ddp_sync is not None and vars(self._ddp[0]).get(_DDP_BUFFER_SYNC) is ddp_sync:
            delattr(self._ddp[0], _DDP_BUFFER_SYNC)  # the class's method again
        restore(self._rebound)
        for name, orig in self._originals.items():
            for module in (dist, dist.distributed_c10d):
                if getattr(module, name, None) is self._wrappers[name]:
                    setattr(module, name, orig)
        self._originals.clear()
        self._wrappers.clear()

    def _wrap(self, name: str, op: str, orig: Callable, label: str | None = None) -> Callable:
        try:
            params = list(inspect.signature(orig).parameters)
        except (TypeError, ValueError):
            params = []
        group_pos = params.index("group") if "group" in params else None
        async_pos = params.index("async_op") if "async_op" in params else None
        state, busy, own = self._state, self._busy, self._self_time
        tap = self._taps.get(name)
        training, timing, group_name_of = self._training_thread, self._timing, self._group_name
        p2p = name in ("batch_isend_irecv", "isend", "irecv")  # asynchronous by nature

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if (
                not self._active
                or hook_context.active
                or busy.on
                or _compiling()
            ):
                return orig(*args, **kwargs)
            t_in = time.perf_counter()
            norm0 = own.grad_norm_s if own is not None else 0.0  # a tap's norm pass: apart
            entry = prev_phase = mark = None
            on_training = threading.get_ident() == training
            is_async = False
            try:
                group = kwargs.get("group")
                if group is None and group_pos is not None and len(args) > group_pos:
                    group = args[group_pos]
                if group is None and name == "batch_isend_irecv" and args and args[0]:
                    group = getattr(args[0][0], "group", None)  # the P2POps' group
                is_async = kwargs.get("async_op")
                if is_async is None and async_pos is not None and len(args) > async_pos:
                    is_async = args[async_pos]
                is_async = is_async or p2p
                if tap is not None and not state.dry_run:  # dry run: made-up gradients
                    tap(args, kwargs, group)
                nbytes = _call_bytes(args, kwargs)
                group_name = label if label is not None else group_name_of(group)
                entry = state.enter_collective(op, group_name, nbytes)
                if on_training and not is_async:
                    prev_phase, state.phase = state.phase, "collective"
                    if timing is not None:
                        mark = timing.blocked_begin()
            except Exception as exc:
                self._fault(name, exc)
            busy.on = True
            t0 = time.perf_counter()
            result = None
            try:
                result = orig(*args, **kwargs)
                return result
            finally:
                busy.on = False
                t1 = time.perf_counter()
                try:
                    dt = t1 - t0
                    if entry is not None:
                        state.finish_collective(entry, dt)
                        if prev_phase is not None:
                            state.comm_s += dt
                            state.phase = prev_phase
                        if mark is not None:
                            timing.blocked_end(mark)
                        if is_async and on_training and self._works is not None:
                            self._works.watch(result, entry)
                        if is_async and self._foreign is not None and op == "allreduce":
                            self._watch_foreign(result, entry, group, t0, dt)
                except Exception as exc:
                    self._fault(name, exc)
                if own is not None and on_training:
                    norm = own.grad_norm_s - norm0
                    own.collectives_s += (t0 - t_in) - norm + (time.perf_counter() - t1)

        wrapper.__rankscope_wrapped__ = True
        return wrapper

    def _watch_foreign(self, work: Any, entry: dict, group: Any, t0: float, dt: float) -> None:
        """A bucket reduction launched by the user's own DDP hook: its launch counts as
        ``comm_s`` and its completion closes the tail backward waits for, as for the
        collector's own hook (``StepState.backward_wait_s``)."""
        if work is None or (group is not None and group_key(group) != group_key(self._foreign)):
            return
        st = self._state
        st.comm_s += dt
        st.last_launch_exit_perf = t0 + dt

        def done(_fut) -> None:
            try:
                now = time.perf_counter()
                st.finish_collective(entry, now - t0)
                if st.last_done_perf is None or now > st.last_done_perf:
                    st.last_done_perf = now
            except Exception as exc:
                self._fault("allreduce (a DDP hook's)", exc)

        work.get_future().add_done_callback(done)

    def _fault(self, name: str, exc: Exception) -> None:
        if self._faults is not None:
            self._faults.hit(f"collective bookkeeping ({name})", exc)
        else:
            log.debug("collective bookkeeping failed for %s: %s", name, exc)

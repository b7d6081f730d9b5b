"""Timing functional collectives: what DTensor (tensor parallel) communicates with.

DTensor redistributions call ``torch.distributed._functional_collectives``
(``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ...). A
functional collective returns at once with an ``AsyncCollectiveTensor``; the
rank blocks later, when the result is first used, in that module's
``wait_tensor``. The collector wraps both at attach (restored at close like
``dist_wrap``): the launch records op, group, per-group sequence number and
bytes; the wait's seconds on the training thread are added to that entry's
``s`` and to ``comm_s`` (on CUDA bracketed with timing events,
``device_timing``). A wait whose launch was not seen (a result made before
attach) still counts as ``comm_s``. Loops call them on plain tensors too (a
mixture of experts' ``all_to_all_single_autograd``), so they are wrapped for
every model. Their backward's collective is launched inside autograd, unseen
(no entry); where torch waits for it through this module's ``wait_tensor``
(torch 2.15 does), the wait is ``comm_s`` like any other on the training
thread (CPU backward runs there; CUDA's runs on autograd's own threads, not
seen). While
``torch.compile`` traces, the wrappers pass straight through (the compiled
graph's collectives are not seen).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from rankscope.collectors.rank.by_name import rebind, restore
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.step_state import StepState
from rankscope.collectors.rank.work_wait import timed_wait

__all__ = ["FuncolPatch", "FUNCOL_OPS"]

FUNCOL_OPS = {
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce",
    "all_gather_single": "allgather",
    "all_gather_tensor": "allgather",
    "all_gather_into_tensor_coalesced": "allgather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "alltoall",
    "broadcast": "broadcast",
}
_MAX_PENDING = 4096  # launches awaiting their wait; older ones are forgotten


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _resolve(funcol: Any, group: Any) -> Any:
    """The ProcessGroup behind a functional collective's ``group`` argument."""
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
        return group[0].get_group(group[1])
    if hasattr(group, "get_group") and getattr(group, "ndim", 0) == 1:
        return group.get_group()
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


def _group_arg(args: tuple, kwargs: dict) -> Any:
    g = kwargs.get("group")
    if g is not None:
        return g
    for a in args[1:]:
        if isinstance(a, (tuple, str)) or hasattr(a, "get_group") or hasattr(a, "group_name"):
            return a
    return None


class FuncolPatch:
    """Installs and removes the functional-collective wrappers for one collector."""

    def __init__(
        self,
        state: StepState,
        group_name: Callable[[Any], str],
        training_thread: int,
        faults: Faults,
        timing: Any = None,
    ) -> None:
        self._state = state
        self._timing = timing  # device_timing.DeviceTiming on CUDA: brackets the waits
        self._group_name = group_name
        self._training_thread = training_thread
        self._faults = faults
        self._pending: dict[int, dict] = {}  # id(result tensor) -> collective entry
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._active = False
        self._module: Any = None
        self._rebound: list = []  # by_name.rebind: modules that imported a function by name

    def install(self) -> None:
        try:
            import torch.distributed._functional_collectives as funcol
        except Exception:
            return
        self._module, self._active = funcol, True
        for name, op in FUNCOL_OPS.items():
            orig = getattr(funcol, name, None)
            if callable(orig):
                self._put(name, orig, self._wrap_launch(op, orig))
        wait = getattr(funcol, "wait_tensor", None)
        if callable(wait):
            self._put("wait_tensor", wait, self._wrap_wait(wait))
        self._rebound = rebind(self._originals, self._wrappers)

    def _put(self, name: str, orig: Callable, wrapper: Callable) -> None:
        self._originals[name], self._wrappers[name] = orig, wrapper
        setattr(self._module, name, wrapper)

    def uninstall(self) -> None:
        self._active = False
        restore(self._rebound)
        for name, orig in self._originals.items():
            if getattr(self._module, name, None) is self._wrappers[name]:
                setattr(self._module, name, orig)
        self._originals.clear()
        self._wrappers.clear()
        self._pending.clear()

    def step_done(self) -> None:
        """Forget launches never waited for (their tensors are gone by now)."""
        self._pending.clear()

    def _wrap_launch(self, op: str, orig: Callable) -> Callable:
        state = self._state

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            if not self._active or _compiling():
                return out
            try:
                group = _resolve(self._module, _group_arg(args, kwargs))
                t = args[0] if args else kwargs.get("self", kwargs.get("input"))
                nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else None
                entry = state.enter_collective(op, self._group_name(group), nbytes)
                entry["s"] = 0.0
                for res in out if isinstance(out, (list, tuple)) else (out,):
                    elem = getattr(res, "elem", None)
                    if isinstance(elem, torch.Tensor) and len(self._pending) < _MAX_PENDING:
                        self._pending[id(elem)] = entry
            except Exception as exc:
                self._faults.hit(f"functional collective bookkeeping ({op})", exc)
            return out

        wrapper.__rankscope_wrapped__ = True
        return wrapper

    def _wrap_wait(self, orig: Callable) -> Callable:
        state = self._state

        @functools.wraps(orig)
        def wait_tensor(tensor, *args, **kwargs):
            if (
                not self._active
                or _compiling()
                or threading.get_ident() != self._training_thread
            ):
                return orig(tensor, *args, **kwargs)
            entry = self._pending.pop(id(tensor), None)  # None: launched before attach
            return timed_wait(state, self._timing, entry, self._fault,
                              lambda: orig(tensor, *args, **kwargs))  # fmt: skip

        wait_tensor.__rankscope_wrapped__ = True
        return wait_tensor

    def _fault(self, exc: Exception) -> None:
        self._faults.hit("functional collective bookkeeping (wait)", exc)

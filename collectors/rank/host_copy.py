"""Device values to the host without a host-device sync (CUDA).

``float(cuda_tensor)`` on the sender thread is a synchronizing copy: under
``torch.cuda.set_sync_debug_mode("error")`` (a process-wide setting) it
raises, and it stalls the sender behind the whole queue of kernels. The
thread that made the values queues instead one ``non_blocking`` copy into
pinned host memory plus an event after it; the reader polls the event
(bounded) and then reads plain host memory. CPU tensors pass through.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rankscope.collectors.rank.amp import Unscaled

__all__ = ["HostTensor", "offload_record", "to_host"]

_WAIT_S = 2.0
_POLL_S = 0.001


def _on_cuda(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


class HostTensor:
    """A device tensor's copy on its way to pinned host memory."""

    __slots__ = ("_host", "event")

    def __init__(self, t: torch.Tensor) -> None:
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t.detach(), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def host(self) -> torch.Tensor:
        """The host copy once the device wrote it; raises after a bounded wait."""
        deadline = time.monotonic() + _WAIT_S
        while not self.event.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"device copy not complete after {_WAIT_S:.0f} s")
            time.sleep(_POLL_S)
        return self._host

    def numpy(self) -> Any:
        return self.host().numpy()


def to_host(t: Any) -> Any:
    """``t`` as a ``HostTensor`` when it lives on CUDA, else unchanged."""
    return HostTensor(t) if _on_cuda(t) else t


class _Slot:
    """One scalar of a record's batched host copy."""

    __slots__ = ("_copy", "_i")

    def __init__(self, copy: list, i: int) -> None:
        self._copy, self._i = copy, i

    def __float__(self) -> float:
        return float(self._copy[0].host()[self._i])

    def __int__(self) -> int:
        return int(float(self))


def offload_record(p: dict) -> Any:
    """Swap the CUDA scalars of pending record ``p`` (loss, lr, norms, counts) for
    slots of one batched copy; returns that copy's event (None: nothing on CUDA)."""
    found: list[torch.Tensor] = []
    copy: list = []

    def swap(x: Any) -> Any:
        if _on_cuda(x):
            found.append(x.detach().reshape(()).to(torch.float64))
            return _Slot(copy, len(found) - 1)
        if isinstance(x, Unscaled):
            return Unscaled(*(swap(v) for v in x.parts()))
        return x

    for key in ("loss", "lr"):
        p[key] = swap(p.get(key))
    for key in ("local", "reduced", "nonfinite"):
        p[key] = [swap(v) for v in p.get(key) or ()]
    if not found:
        return None
    copy.append(HostTensor(torch.stack(found)))
    return copy[0].event

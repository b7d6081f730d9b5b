"""Emulated accelerator time, and the slowdowns that stretch it.

On a GPU cluster each rank computes on its own device, so one slow rank does
not slow its peers' compute; here eight ranks share two CPU cores, and a rank
that merely computes longer steals CPU from the others, which blurs exactly
the contrast a straggler detector looks for. So each rank also spends
"device time" in proportion to the tokens of its batch (a sleep, which uses
no CPU), the way a kernel would: forward ``device_us_per_token`` per token,
backward twice that. Real CPU compute still happens and still varies.

Slowdowns (the ``straggler`` fault) register a scaler: in a scaled phase the
clock sleeps ``factor - 1`` times the measured compute of that phase (real
work plus device time) on top, inside the forward hook and the gradient
hooks, i.e. before DDP sees the gradients: peers end up waiting in the
all-reduce, and the slow rank's own ``compute_s`` grows. With
``watch_optimizer`` the optimizer step is a phase too (``optimizer``), so a
whole-step slowdown stretches all of the step's work but the loss and the
gradient clipping (a fraction of a millisecond here).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["DeviceClock"]

_MIN_SLEEP_S = 0.0005  # shorter sleeps cost more than they buy; carry the debt


class _SleepDebt:
    """Sleep owed to the emulation, paid in chunks; oversleep becomes credit."""

    __slots__ = ("owed_s",)

    def __init__(self) -> None:
        self.owed_s = 0.0

    def pay(self, min_s: float = _MIN_SLEEP_S) -> None:
        if self.owed_s > 0.0 and self.owed_s >= min_s:  # sleep(0) yields: no credit from it
            t0 = time.perf_counter()
            time.sleep(self.owed_s)
            self.owed_s -= time.perf_counter() - t0


class DeviceClock:
    """Hooks on the bare model that add device time and apply registered slowdowns."""

    def __init__(self, model: torch.nn.Module, *, us_per_token: float, step_fn: Callable[[], int]):
        if us_per_token < 0:
            raise ValueError("device time per token should be >= 0")
        self.s_per_token = us_per_token * 1e-6
        self._step = step_fn
        self._scalers: list[Callable[[str, int], float]] = []
        self._debt = _SleepDebt()
        self._mark = 0.0
        self._tokens = 0
        self._bwd_factor = 1.0
        self._seen = 0
        self._opt_mark = 0.0
        params = [p for p in model.parameters() if p.requires_grad]
        self._n_params = len(params)
        model.register_forward_pre_hook(self._pre_forward)
        model.register_forward_hook(self._post_forward)
        for p in params:
            p.register_hook(self._on_grad)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Stretch the optimizer step too (phase ``optimizer``): on a GPU it is device work.

        Register before anything that closes the step on the optimizer's post-hook
        (the rank collector), so the step's times include the stretch.
        """
        optimizer.register_step_pre_hook(self._pre_step)
        optimizer.register_step_post_hook(self._post_step)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self._opt_mark = time.perf_counter()

    def _post_step(self, optimizer, args, kwargs) -> None:
        f = self.factor("optimizer")
        if f != 1.0:
            self._debt.owed_s += (f - 1.0) * (time.perf_counter() - self._opt_mark)
            self._debt.pay(min_s=0.0)

    def add_scaler(self, scaler: Callable[[str, int], float]) -> None:
        """``scaler(phase, step) -> factor`` (1.0 = normal speed); factors multiply."""
        self._scalers.append(scaler)

    def factor(self, phase: str) -> float:
        step = self._step()
        out = 1.0
        for scaler in self._scalers:
            out *= scaler(phase, step)
        return out

    def _pre_forward(self, module, args) -> None:
        self._mark = time.perf_counter()
        tokens = args[0] if args else None
        self._tokens = int(tokens.numel()) if isinstance(tokens, torch.Tensor) else 0

    def _post_forward(self, module, args, out) -> None:
        f = self.factor("forward")
        device_s = self._tokens * self.s_per_token
        real_s = time.perf_counter() - self._mark
        self._debt.owed_s += device_s * f + (f - 1.0) * real_s
        self._debt.pay(min_s=0.0)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._start_backward)

    def _start_backward(self, grad):
        self._bwd_factor = self.factor("backward")
        self._seen = 0
        self._debt.owed_s += 2.0 * self._tokens * self.s_per_token * self._bwd_factor
        self._debt.pay(min_s=0.0)
        self._mark = time.perf_counter()
        return None

    def _on_grad(self, grad):
        self._seen += 1
        last = self._seen >= self._n_params
        if self._bwd_factor != 1.0:
            now = time.perf_counter()
            self._debt.owed_s += (self._bwd_factor - 1.0) * (now - self._mark)
            self._debt.pay(min_s=0.0 if last else _MIN_SLEEP_S)
            self._mark = time.perf_counter()
        return None

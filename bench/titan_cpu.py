"""torchtitan's own trainer on CPU (gloo), the collector attached, faults from outside.

Run by ``bench_torchtitan.py`` under ``torchrun`` with torchtitan on
``PYTHONPATH`` (the ``.titan`` overlay ``make titan`` installs) and the usual
torchtitan arguments (``--module llama3 --config llama3_debugmodel ...``).
torchtitan targets accelerators; four shims let its unchanged training loop
run on gloo, each at the boundary where CPU lacks something:

- the device type is ``cpu`` (torchtitan falls back to ``cuda``), and
  ``torch.cpu`` gets the memory-statistics calls its monitor makes (zeros);
- FlexAttention has no CPU backward: its compiled kernel is replaced by
  causal scaled-dot-product attention (documents are not masked apart);
- gloo has no PREMUL_SUM: a gradient divide factor of 1 (torchtitan scales
  by tokens itself) is a plain SUM, which is what it means;
- ``set_pg_timeouts``' barrier passes a CPU device id gloo refuses: skipped.

The collector attaches after the trainer is built, as a torchtitan user adds
it: ``RankCollector.attach(model_parts, optimizers, topology=parallel_dims)``.
Env: ``RANKSCOPE_SINK`` (no collector without it), ``RANKSCOPE_JOB``,
``RANKSCOPE_FAULT`` (JSON: ``kind`` straggler with ``sleep_s``, or nonfinite;
``rank``; ``from``: the step it starts).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"
for _name, _fn in {
    "get_device_name": lambda *a: "cpu",
    "reset_peak_memory_stats": lambda *a: None,
    "empty_cache": lambda *a: None,
    "memory_stats": lambda *a: {},
    "get_device_properties": lambda *a: SimpleNamespace(total_memory=1 << 34),
}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)

from torch.distributed.fsdp import FSDPModule  # noqa: E402

_set_divide = FSDPModule.set_gradient_divide_factor


def _set_divide_gloo(self, factor):
    _set_divide(self, factor)
    if factor == 1.0:
        self.set_force_sum_reduction_for_comms(True)


FSDPModule.set_gradient_divide_factor = _set_divide_gloo

import torchtitan.distributed.utils as _titan_dist  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

_titan_dist.set_pg_timeouts = lambda *a, **k: None


def _causal_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                      enable_gqa=False, return_aux=None, kernel_options=None):  # fmt: skip
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out, SimpleNamespace(lse=None, max_scores=None)


FlexAttention._compiled_flex_attn = _causal_attention


class _Steps:
    """The optimizer steps taken (its post-hook), and whether this step has run a
    forward yet (a pipeline stage runs one per micro-batch)."""

    def __init__(self, optimizers) -> None:
        self.n, self.started = 0, False
        optimizers.register_step_post_hook(self._post)

    def _post(self, *a) -> None:
        self.n += 1
        self.started = False

    def first_forward(self) -> bool:
        was, self.started = self.started, True
        return not was


def _install_fault(trainer, fault: dict) -> None:
    """A straggler sleeps ``sleep_s`` in the first forward of each step from ``from``
    (the bench sizes it from the style's clean compute); a non-finite fault makes
    this rank's logits NaN at step ``from`` (its loss, then its gradients)."""
    if torch.distributed.get_rank() != fault["rank"]:
        return
    steps = _Steps(trainer.optimizers)
    parts = trainer.model_parts
    if fault["kind"] == "straggler":

        def slow(module, args):
            if steps.first_forward() and steps.n >= fault["from"]:
                time.sleep(fault["sleep_s"])

        for part in parts:
            part.register_forward_pre_hook(slow)
    elif fault["kind"] == "nonfinite":
        last = [m for m in parts[-1].modules() if isinstance(m, torch.nn.Linear)][-1]

        def poison(module, args, out):
            return out * float("nan") if steps.n == fault["from"] else out

        last.register_forward_hook(poison)


_build = Trainer.__init__


def _init(self, *args, **kwargs) -> None:
    _build(self, *args, **kwargs)
    sink = os.environ.get("RANKSCOPE_SINK")
    if sink:
        from rankscope.collectors import RankCollector

        parts = self.model_parts
        self._rankscope = RankCollector.attach(
            parts if len(parts) > 1 else parts[0], self.optimizers,
            job=os.environ.get("RANKSCOPE_JOB", "titan"), sink=sink, host="node00",
            topology=self.parallel_dims,
        )  # fmt: skip
    fault = json.loads(os.environ.get("RANKSCOPE_FAULT") or "null")
    if fault:  # after attach: its forward hook runs after the collector's (compute, not input)
        _install_fault(self, fault)


Trainer.__init__ = _init

if __name__ == "__main__":
    from torchtitan.train import main

    main()

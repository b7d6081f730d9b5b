"""Turning one step's raw measurements into a ``step`` record (sender thread).

The training thread hands over what it measured as cheap references (lazy
tensors, lists of per-bucket norms, a digest callable); the conversions that
may wait for a device, the hashing and the clean-up of non-finite values
happen here, on the sender thread.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from rankscope.collectors.schema.records import StepRecord

__all__ = ["build_step_record"]

log = logging.getLogger("rankscope.collectors")

_COPIED = ("step", "t", "step_s", "data_s", "comm_s", "compute_s")


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        out = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return out if math.isfinite(out) else None


def _combine_norms(norms: list) -> float | None:
    if not norms:
        return None
    total = 0.0
    for n in norms:
        v = float(n)
        total += v * v
    return math.sqrt(total) if math.isfinite(total) else None


def build_step_record(base: dict, p: dict) -> dict:
    """The record dict for pending step ``p`` of the rank described by ``base``.

    Non-finite readings are left out (JSON has no NaN), never written as null
    strings; a digest that could not be computed is left out too.
    """
    rec = dict(base)
    for k in _COPIED:
        rec[k] = p[k]
    loss = _as_float(p["loss"])
    if loss is not None:
        rec["loss"] = loss
    lr = _as_float(p["lr"])
    if lr is not None:
        rec["lr"] = lr
    if p["local"]:
        rec["grad_norm"] = _combine_norms(p["local"])
        rec["nonfinite"] = int(sum(int(x) for x in p["nonfinite"]))
    if p["reduced"]:
        rec["grad_norm_reduced"] = _combine_norms(p["reduced"])
    if p["digest"] is not None:
        try:
            rec["param_digest"] = p["digest"]()
        except Exception as exc:
            log.debug("param digest failed: %s", exc)
    if p.get("tokens"):
        rec["tokens"] = int(p["tokens"])
    if p["collectives"]:
        rec["collectives"] = [dict(c) for c in p["collectives"]]
    if p.get("skipped"):
        rec["skipped"] = True
    return StepRecord(**rec).to_dict()  # the contract's shape; absent readings left out

"""Turning one step's raw measurements into a ``step`` record (sender thread).

The training thread hands over what it measured as cheap references (lazy
tensors, lists of per-bucket norms, a digest callable); the conversions that
may wait for a device, the hashing and the naming of non-finite values
happen here, on the sender thread, and so does reading the step's CUDA timing
events (``device_timing``: device ``compute_s``/``comm_s``). A non-finite
``loss``, ``lr`` or gradient norm is data (the evidence of a NaN origin): it
is written as null with
``nonfinite_fields`` naming the value ("NaN", "Infinity", "-Infinity"), so a
reader can tell it from a reading that was not reported.
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
        return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _combine_norms(norms: list) -> float | None:
    if not norms:
        return None
    total = 0.0
    for n in norms:
        v = float(n)
        total += v * v
    return math.sqrt(total)


def _token(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _put(rec: dict, name: str, value: float | None) -> None:
    """A finite value as is; a non-finite one as null plus its name in nonfinite_fields."""
    if value is None:
        return
    if math.isfinite(value):
        rec[name] = value
    else:
        rec.setdefault("nonfinite_fields", {})[name] = _token(value)


def build_step_record(base: dict, p: dict) -> dict:
    """The record dict for pending step ``p`` of the rank described by ``base``.

    Non-finite readings are written as null and named in ``nonfinite_fields``
    (JSON has no NaN); readings not taken are left out, and so is a digest
    that could not be computed.
    """
    rec = dict(base)
    for k in _COPIED:
        rec[k] = p[k]
    timing, events = p.get("device") or (None, None)
    device = timing.resolve(events) if events is not None else None
    if device is not None:  # CUDA: device times once the step's events completed
        rec["compute_s"], rec["comm_s"] = device
    elif p.get("cpu_wait_s") is not None:  # wall-time compute_s: the host's share of it
        rec["cpu_wait_s"] = p["cpu_wait_s"]
    _put(rec, "loss", _as_float(p["loss"]))
    _put(rec, "lr", _as_float(p["lr"]))
    if p["local"]:
        _put(rec, "grad_norm", _combine_norms(p["local"]))
        rec["nonfinite"] = int(sum(int(x) for x in p["nonfinite"]))
    if p["reduced"]:
        _put(rec, "grad_norm_reduced", _combine_norms(p["reduced"]))
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

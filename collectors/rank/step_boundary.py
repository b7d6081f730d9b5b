"""What the training thread hands over at a step boundary: timings and lazy readings.

``pending_record`` closes the step in progress: the times out of the step
state, the norms as lists of lazy values (divided by the AMP loss scale where
they were taken under it), the loss (``rc.loss()``'s, else the backward roots'),
the digest callable; ``build_step_record`` turns
it into a record on the sender thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from rankscope.collectors.rank.amp import Unscaled
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.loss_roots import root_loss
from rankscope.collectors.rank.step_state import StepState

__all__ = ["Guarded", "count_tokens", "pending_record"]


def _unscale(norms: list, scale: Any) -> list:
    return [Unscaled(n, scale) for n in norms] if scale is not None and norms else norms


def pending_record(st: StepState, *, digest: Any, lr: Any, skipped: bool) -> dict:
    """The pending record of the step in progress (training thread, no device waits)."""
    now = time.perf_counter()
    step_s = now - st.step_start_perf
    data_s = 0.0
    if st.first_forward_perf is not None:  # time in collectives before it is comm_s alone
        data_s = max(0.0, st.first_forward_perf - st.step_start_perf - st.comm_before_forward_s)
    comm_s = min(st.comm_s + st.backward_wait_s(), max(0.0, step_s - data_s))
    scale = st.loss_scale
    # with DDP buckets, a norm the loop's clipping took is the reduced one (after unscale_)
    if st.clip_norm is not None and st.buckets:
        reduced = [st.clip_norm]
    else:
        reduced = _unscale(st.reduced_sq, scale if st.reduced_scaled else None)
    out = {
        "step": st.step,
        "t": time.time(),
        "step_s": step_s,
        "data_s": data_s,
        "comm_s": comm_s,
        "compute_s": max(0.0, step_s - data_s - comm_s),
        "local": _unscale(st.local_sq, scale if st.local_scaled else None),
        "reduced": reduced,
        "nonfinite": st.nonfinite,
        "collectives": st.collectives,
        "loss": st.loss if st.loss is not None else root_loss(st.roots, scale),
        "digest": digest,
        "lr": lr,
        "tokens": st.tokens,
    }
    if skipped:
        out["skipped"] = True
    wait = st.run_queue.read()
    if wait is not None and st.run_wait_start is not None:  # CPU contention, not this rank
        out["cpu_wait_s"] = min(max(0.0, wait - st.run_wait_start), step_s)
    st.run_wait_start = wait  # one reading ends this step and starts the next
    return out


class Guarded:
    """A digest callable whose failure on the sender thread is counted and said once."""

    __slots__ = ("_fn", "_faults")

    def __init__(self, fn: Any, faults: Faults) -> None:
        self._fn, self._faults = fn, faults

    def __call__(self) -> str:
        try:
            return self._fn()
        except Exception as exc:
            self._faults.hit("param_digest", exc)
            raise


# keyword inputs that are integer tensors but not the step's token ids
_NOT_TOKENS = ("label", "target", "mask", "position", "type_ids")


def _is_ids(a: Any) -> bool:
    return (isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex()
            and a.dtype != torch.bool)  # fmt: skip


def _keyword_ids(kw: Mapping) -> Any:
    ids = kw.get("input_ids")
    if ids is None:
        ids = next((v for k, v in kw.items() if isinstance(v, torch.Tensor)
                    and not any(w in str(k) for w in _NOT_TOKENS)), None)  # fmt: skip
    return ids


def _token_ids(args, kwargs: Mapping | None, nested: bool = False) -> Any:
    """The tensor that holds forward's token ids, if any (see ``count_tokens``)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        found = None
        if not nested and isinstance(a, Mapping):
            found = _keyword_ids(a)
        elif not nested and isinstance(a, (list, tuple)):
            found = _token_ids(a, None, nested=True)
        if found is not None:
            return found
    return _keyword_ids(kwargs) if kwargs else None


def count_tokens(st: StepState, args: tuple, kwargs: Mapping | None = None) -> None:
    """Add the element count of forward's token ids: its first tensor argument when
    that is an integer one (looking one level into a batch passed as a dict, list or
    tuple, as Lightning's ``training_step(batch)`` gets it), else (``model(**batch)``,
    the Hugging Face style) the ``input_ids`` keyword or the first integer keyword
    tensor that is no label, mask or position.

    Work per step scales with tokens, so detectors can compare compute time per
    token across ranks whose batches have different sequence lengths. Models fed
    float tensors report nothing here (``rc.tokens(n)`` does it explicitly).
    """
    ids = _token_ids(args, kwargs)
    if _is_ids(ids):
        st.tokens = (st.tokens or 0) + ids.numel()

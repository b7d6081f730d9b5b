"""``param_digest``: a cheap, full, deterministic fingerprint of the parameters.

The bytes of each parameter tensor are reinterpreted as 64-bit integers
(any trailing bytes as uint8) and summed, wrapping, into one int64 on the
tensor's own device: one read of every parameter byte, no host transfer.
Tensors under 64 KB are concatenated per device and dtype first, so a model
of many small tensors costs a handful of kernels. The vector of sums is
hashed (BLAKE2b, 16 hex digits) later on the sender thread.

Why this and not sampling: a single flipped bit changes the 64-bit word
that holds it by exactly ``±2**k`` (k < 64), so the wrapped int64 sum changes
too; a one-bit flip anywhere is therefore seen at the step it happens, which
a strided sample would miss. Integer addition wraps associatively, so the
result does not depend on reduction order: healthy data-parallel replicas,
which hold bit-identical parameters, get equal digests. What it does not
catch: two corruptions that cancel exactly in the sum, or a permutation of
words; neither is what silent data corruption looks like. (Summing int32
words would be as sensitive but is ~5x slower: torch widens each one.)

``DigestPlan`` keeps the int64 views of the large tensors from one call to
the next (they share the parameters' storage, so they always read current
values) and rebuilds an entry when its parameter was given new storage
(``p.data = ...``): per step that leaves one ``sum`` per large tensor, one
``cat`` + ``sum`` per group of small ones and a ``stack``. The collector
runs it on a background worker (``collectors/digest_worker.py``); measured
figures are in docs/collectors.md. ``digest_every_steps`` thins it out when
that is still too much.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

__all__ = ["DigestPlan", "digest_sums", "digest_hex"]

# Tensors below this many bytes are concatenated per (device, dtype) and
# summed once: for small tensors the per-op dispatch cost dominates.
SMALL_BYTES = 1 << 16


def _int_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Wrapped int64 sums of the bytes of contiguous ``t``: whole 8-byte words
    viewed as int64 (the fast path), the < 8 trailing bytes as uint8."""
    return [v.sum() if v.dtype == torch.int64 else v.sum(dtype=torch.int64) for v in _views(t)]


def _views(t: torch.Tensor) -> list[torch.Tensor]:
    """The int64 word view (and uint8 tail view) of contiguous ``t``, sharing storage
    when its start is 8-byte aligned (else of an aligned copy)."""
    if t.storage_offset() * t.element_size() % 8:
        t = t.clone()  # int64 views need an 8-byte aligned start
    raw = t.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    out = []
    if words:
        out.append(raw[: words * 8].view(torch.int64))
    if raw.numel() > words * 8:
        out.append(raw[words * 8 :])
    return out


def _plain(p: torch.Tensor) -> torch.Tensor:
    """``p`` detached, as a real, non-bool tensor whose bytes can be reinterpreted."""
    t = p.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t


class DigestPlan:
    """The per-step digest work for one fixed list of parameters, views cached."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = list(params)
        # per large parameter: (the (data_ptr, numel) the views were made for, views) or None
        self._cached: list[tuple[tuple, list[torch.Tensor]] | None] = [None] * len(self._params)

    def sums(self) -> list[torch.Tensor]:
        """Int64 sums over the parameters' bytes, stacked per device (never waits
        for a device; same result as ``digest_sums`` of the same parameters)."""
        sums: dict[torch.device, list[torch.Tensor]] = {}
        small: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        cached = self._cached
        with torch.no_grad():
            for i, p in enumerate(self._params):
                entry = cached[i]
                if entry is not None and entry[0] == (p.data_ptr(), p.numel()):
                    views = entry[1]
                else:
                    t = _plain(p)
                    if t.numel() * t.element_size() < SMALL_BYTES:
                        small.setdefault((t.device, t.dtype), []).append(t.reshape(-1))
                        continue
                    views = self._views_for(i, t)
                out = sums.setdefault(views[0].device, [])
                for v in views:
                    out.append(v.sum() if v.dtype == torch.int64 else v.sum(dtype=torch.int64))
            for (device, _), tensors in small.items():
                flat = torch.cat(tensors) if len(tensors) > 1 else tensors[0].contiguous()
                sums.setdefault(device, []).extend(_int_sums(flat))
        return [torch.stack(s) for s in sums.values()]

    def _views_for(self, i: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Views of a large tensor; cached only when they share its storage."""
        p = self._params[i]
        shares = t.data_ptr() == p.data_ptr()  # not a converted copy (bool)
        if shares and t.is_contiguous() and not t.storage_offset() * t.element_size() % 8:
            views = _views(t)
            self._cached[i] = ((p.data_ptr(), p.numel()), views)
            return views
        self._cached[i] = None
        return _views(t.contiguous())


def digest_sums(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Int64 sums over the parameters' bytes, stacked per device (one-off plan)."""
    return DigestPlan(params).sums()


def digest_hex(stacks: list[torch.Tensor]) -> str:
    """Hash the stacked sums into 16 hex digits (sender thread: may wait for the device)."""
    h = hashlib.blake2b(digest_size=8)
    for s in stacks:
        h.update(s.cpu().numpy().tobytes())
    return h.hexdigest()


"""``param_digest``: a cheap, full, deterministic fingerprint of the parameters.

The bytes of each parameter tensor are reinterpreted as 64-bit integers
(any trailing bytes as uint8) and summed, wrapping, into one int64 on the
tensor's own device: one read of every parameter byte, no host transfer on
the training thread. Tensors under 256 KB are concatenated per device and
dtype first, so a model of many small tensors costs a handful of kernels.
The vector of sums is hashed (BLAKE2b, 16 hex digits) later on the sender
thread.

Why this and not sampling: a single flipped bit changes the 64-bit word
that holds it by exactly ``±2**k`` (k < 64), so the wrapped int64 sum changes
too; a one-bit flip anywhere is therefore seen at the step it happens, which
a strided sample would miss. Integer addition wraps associatively, so the
result does not depend on reduction order: healthy data-parallel replicas,
which hold bit-identical parameters, get equal digests. What it does not
catch: two corruptions that cancel exactly in the sum, or a permutation of
words; neither is what silent data corruption looks like.

Cost: one read of the parameter bytes per digest (memory-bandwidth bound)
plus a copy of the small tensors; measured figures are in
docs/collectors.md. ``digest_every_steps`` thins it out when that is still
too much.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

__all__ = ["digest_sums", "digest_hex", "lazy_digest"]

# Tensors below this many bytes are concatenated per (device, dtype) and
# summed once: for small models the per-op dispatch cost dominates.
SMALL_BYTES = 1 << 18


def _int_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Wrapped int64 sums of the bytes of contiguous ``t``: whole 8-byte words
    viewed as int64 (the fast path), the < 8 trailing bytes as uint8."""
    if t.storage_offset() * t.element_size() % 8:
        t = t.clone()  # int64 views need an 8-byte aligned start
    raw = t.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    out = []
    if words:
        out.append(raw[: words * 8].view(torch.int64).sum())
    if raw.numel() > words * 8:
        out.append(raw[words * 8 :].sum(dtype=torch.int64))
    return out


def digest_sums(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Int64 sums over the parameters' bytes, stacked per device.

    Runs on the training thread; launches a few reductions and never waits
    for a device. Large tensors are summed in place (no copy); small ones of
    one device and dtype are concatenated first so a model of many small
    tensors costs a handful of kernels rather than one per tensor.
    """
    sums: dict[torch.device, list[torch.Tensor]] = {}
    small: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    with torch.no_grad():
        for p in params:
            t = p.detach()
            if t.is_complex():
                t = torch.view_as_real(t)
            if t.dtype == torch.bool:
                t = t.to(torch.uint8)
            if t.numel() * t.element_size() < SMALL_BYTES:
                small.setdefault((t.device, t.dtype), []).append(t.reshape(-1))
                continue
            if not t.is_contiguous() or t.storage_offset() * t.element_size() % 8:
                t = t.contiguous()
            sums.setdefault(t.device, []).extend(_int_sums(t))
        for (device, _), tensors in small.items():
            flat = torch.cat(tensors) if len(tensors) > 1 else tensors[0].contiguous()
            sums.setdefault(device, []).extend(_int_sums(flat))
    return [torch.stack(s) for s in sums.values()]


def digest_hex(stacks: list[torch.Tensor]) -> str:
    """Hash the stacked sums into 16 hex digits (sender thread: may wait for the device)."""
    h = hashlib.blake2b(digest_size=8)
    for s in stacks:
        h.update(s.cpu().numpy().tobytes())
    return h.hexdigest()


def lazy_digest(params: Iterable[torch.Tensor]) -> Callable[[], str]:
    """Start the device work now; return a callable that finishes the hash later."""
    stacks = digest_sums(params)
    return lambda: digest_hex(stacks)

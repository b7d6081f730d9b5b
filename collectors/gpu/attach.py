"""Run the GPU collector inside a training rank, next to its rank collector.

Each rank samples only its own GPU and stamps its own rank on the readings,
so a host of eight ranks sends eight GPUs' worth of records without a
sidecar and without anyone writing a rank map. Records go through the rank
collector's sender: one bounded queue, one file per process.

Which GPU is "its own": the CUDA device the process uses (the current device
once CUDA is initialised, else ``LOCAL_RANK``, as torchrun sets it), then
translated from CUDA's numbering to NVML's through ``CUDA_VISIBLE_DEVICES``
(an index or a GPU UUID). NVML numbers GPUs in PCI bus order; CUDA does too
when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which multi-GPU launchers set.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from typing import Any

from rankscope.collectors.gpu.collector import GpuCollector, GpuCollectorConfig

__all__ = ["attach_for_rank", "local_cuda_index", "nvml_selector"]

log = logging.getLogger("rankscope.collectors")


def local_cuda_index(env: Mapping[str, str] | None = None) -> int:
    """The CUDA device index this process uses (without initialising CUDA)."""
    env = os.environ if env is None else env
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no torch / no CUDA: fall back to the launcher's word
        pass
    try:
        return int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def nvml_selector(cuda_index: int, env: Mapping[str, str] | None = None) -> int | str:
    """NVML index (or GPU UUID) of CUDA device ``cuda_index`` under ``CUDA_VISIBLE_DEVICES``."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= cuda_index < len(entries):
        return cuda_index
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


def attach_for_rank(
    rc: Any,
    *,
    device: int | str | None = None,
    config: GpuCollectorConfig | None = None,
    nvml: Any = None,
    env: Mapping[str, str] | None = None,
) -> GpuCollector:
    """Start a GPU collector for ``rc``'s rank; closed at exit before ``rc``.

    ``device``: NVML index or UUID to sample (default: this process's GPU).
    Never raises for a missing driver: the collector logs one notice and idles.
    """
    ident = rc.identity
    selector = device if device is not None else nvml_selector(local_cuda_index(env), env)
    sender = getattr(rc, "sender", None) or rc._sender
    coll = GpuCollector(
        rc.job,
        host=ident.host,
        devices=[selector],
        rank=ident.rank,
        config=config,
        nvml=nvml,
        sender=sender,
    )
    coll.start()
    # atexit runs last-registered first: this closes before the rank collector's sender.
    atexit.register(coll.close)
    return coll

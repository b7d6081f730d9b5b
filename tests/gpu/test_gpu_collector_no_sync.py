"""The rank collector on a real CUDA device: the training thread never synchronizes.

Marked ``gpu``; skipped with the reason where CUDA is absent. Under
``torch.cuda.set_sync_debug_mode("error")`` any host-device synchronization on
the training thread raises; the collector's hooks, norms and digest must cause
none (conversions happen on the sender thread). The longer check, CUDA timing
against ``torch.cuda._sleep`` and two ranks sharing one GPU over gloo, is
``scripts/gpu_check.py``.
"""

from __future__ import annotations

import queue

import pytest
import torch
from rankscope.collectors import RankCollector
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def test_training_loop_under_sync_debug_error_mode():
    q: queue.Queue = queue.Queue()
    register_channel("gpu-nosync", q)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1)).cuda()  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device="cuda")
    rc = RankCollector.attach(model, opt, job="g", sink="embedded://gpu-nosync", rank=0, world=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            rc.loss(loss)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rc.close()
    unregister_channel("gpu-nosync")
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(5)) and not rc.faults
    assert all("param_digest" in r and "grad_norm" in r for r in steps)

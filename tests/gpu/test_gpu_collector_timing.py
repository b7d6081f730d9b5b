"""The rank collector on a real CUDA device: device timing and no host-device sync.

Marked ``gpu``; skipped with the reason where CUDA is absent. The checks are
``scripts/gpu_check.py``'s (the one prepared script a lent device runs):
``compute_s`` against a known ``torch.cuda._sleep``; a loop under
``torch.cuda.set_sync_debug_mode("error")`` until the collector closed; two
ranks sharing the GPU over gloo, the slow one seen in compute_s and comm_s.
"""

from __future__ import annotations

import sys

import pytest
import torch
from support.paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


@pytest.mark.parametrize("check", ["check_timing", "check_no_sync", "check_pair"])
def test_gpu_check(check, tmp_path):
    ok, msg = getattr(gpu_check, check)(str(tmp_path))
    assert ok, msg

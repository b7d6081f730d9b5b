"""``scripts/gpu_check.py``'s CPU side: it imports, refuses politely without CUDA,
and its pair check (two DDP ranks over gloo, rank 1 with 1.5x the "device"
work) passes on CPU, where ``time.sleep`` stands in for the spinning kernel
and the CPU clock is the right one. On a GPU tests/gpu runs all its checks."""

from __future__ import annotations

import sys

import pytest
import torch
from support.paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.multiproc


def test_pair_check_on_cpu_sees_the_slow_rank(tmp_path):
    ok, msg = gpu_check.check_pair(str(tmp_path), device="cpu")
    print(msg)
    assert ok, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_cuda_the_script_says_so_and_fails(capsys):
    assert gpu_check.main([]) == 1
    assert "no CUDA device" in capsys.readouterr().out

"""The parameter digest's cached plan and its background worker.

The plan keeps int64 views of large parameters between steps; these tests
check that the reused views still see a one-bit flip made in place, that a
parameter given new storage is re-read, and that the worker digests the
parameters as the step left them even when they change while it reads.
"""

from __future__ import annotations

import threading

import pytest
import torch
from rankscope.collectors.rank.digest import SMALL_BYTES, DigestPlan, digest_hex, digest_sums
from rankscope.collectors.rank.digest_worker import DigestWorker, InlineDigest, make_digester

INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    big = SMALL_BYTES // torch.tensor([], dtype=dtype).element_size() + 3  # odd tail bytes
    return [
        torch.randn(big, generator=gen).to(dtype),
        torch.randn(7, 5, generator=gen).to(dtype),
        torch.randn(big + 64, generator=gen).to(dtype)[64:],  # view: storage offset
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_reused_plan_sees_in_place_bit_flips_in_large_tensors(dtype):
    params = _params(dtype)
    plan = DigestPlan(params)
    clean = digest_hex(plan.sums())
    assert clean == digest_hex(digest_sums([p.clone() for p in params]))
    int_dtype = INT_OF[params[0].element_size()]
    width = params[0].element_size() * 8
    for which in (0, 2):
        flat = params[which].view(int_dtype)
        for index in (0, flat.numel() - 1):  # first word and the odd tail
            for bit in range(0, width, 3):
                mask = torch.tensor(1, dtype=int_dtype) << bit
                flat[index] ^= mask
                assert digest_hex(plan.sums()) != clean, (which, index, bit)
                flat[index] ^= mask
                assert digest_hex(plan.sums()) == clean


def test_plan_rereads_a_parameter_given_new_storage():
    p = torch.nn.Parameter(torch.randn(SMALL_BYTES // 4 + 1))
    plan = DigestPlan([p])
    before = digest_hex(plan.sums())
    p.data = p.data.clone()
    assert digest_hex(plan.sums()) == before
    p.data = p.data * 2
    assert digest_hex(plan.sums()) == digest_hex(digest_sums([p]))
    assert digest_hex(plan.sums()) != before


def test_worker_digest_equals_the_inline_digest_and_joins_before_changes():
    params = _params(torch.float32)
    worker = DigestWorker(params)
    try:
        job = worker.start()
        worker.join()
        assert job() == digest_hex(digest_sums(params))
        with torch.no_grad():
            params[0].add_(1.0)  # the "optimizer step" after the join
        assert job() != digest_hex(digest_sums(params))  # the job kept the old state
    finally:
        worker.close()


def test_worker_rereads_when_parameters_change_while_it_reads(monkeypatch):
    params = _params(torch.float32)
    worker = DigestWorker(params)
    real = DigestPlan.sums
    calls = []

    def sums_then_mutate(self):
        out = real(self)
        calls.append(1)
        if len(calls) == 1:  # a weight clamp landing in the middle of the first read
            with torch.no_grad():
                params[1].clamp_(-0.1, 0.1)
        return out

    monkeypatch.setattr(DigestPlan, "sums", sums_then_mutate)
    try:
        job = worker.start()
        assert job.wait(5.0)  # the worker's read, not one taken over by join()
        worker.join()
        assert len(calls) == 2 and worker.stolen == 0
        monkeypatch.setattr(DigestPlan, "sums", real)
        assert job() == digest_hex(digest_sums(params))  # the clamped state, not a torn one
    finally:
        worker.close()


def test_join_takes_over_a_job_the_worker_has_not_started():
    params = _params(torch.float32)
    worker = DigestWorker(params)
    worker._jobs.put(None)  # the worker thread ends: as if it were never scheduled
    worker._thread.join(5.0)
    job = worker.start()
    worker.join()  # must not wait 5 s for a worker that never comes
    assert worker.stolen == 1 and worker.waits == 0
    assert job() == digest_hex(digest_sums(params))
    worker.close()


def test_job_without_result_raises_for_the_sender_instead_of_a_wrong_digest(monkeypatch):
    params = _params(torch.float32)
    worker = DigestWorker(params)
    monkeypatch.setattr(DigestPlan, "sums", lambda self: 1 / 0)
    try:
        job = worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="not computed"):
            job()
    finally:
        worker.close()
    assert not any(t.name == "rankscope-digest" and t.is_alive() for t in threading.enumerate())


def test_inline_and_background_digesters_agree():
    params = _params(torch.float16)
    inline = make_digester(params, background=False, name="t")
    worker = make_digester(params, background=True, name="t")
    assert isinstance(inline, InlineDigest) and isinstance(worker, DigestWorker)
    try:
        a, b = inline.start(), worker.start()
        worker.join()
        assert a() == b() == digest_hex(digest_sums(params))
    finally:
        inline.close()
        worker.close()


def test_unaligned_view_digests_like_its_aligned_copy_and_sees_a_flip():
    """Words count from the tensor's first byte, wherever it starts in memory, so a
    replica whose parameter happens to start off an 8-byte boundary agrees."""
    base = torch.randn(SMALL_BYTES // 2 + 11, generator=torch.Generator().manual_seed(3))
    view = base.to(torch.float16)[1:]  # starts 2 bytes into its storage
    assert view.data_ptr() % 8
    plan = DigestPlan([view])
    clean = digest_hex(plan.sums())
    assert clean == digest_hex(digest_sums([view.clone()]))
    flat = view.view(torch.int16)
    flat[5] ^= 1 << 9
    assert digest_hex(plan.sums()) != clean
    flat[5] ^= 1 << 9
    assert digest_hex(plan.sums()) == clean

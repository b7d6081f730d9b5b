"""The all-reduce tap of loops that average their gradients themselves."""

from __future__ import annotations

import math

import torch
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_fallback import fallback_grad_stats
from rankscope.collectors.rank.manual_reduce import GradAllReduceTap
from rankscope.collectors.rank.step_state import StepState


def _model_after_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model, list(model.parameters())


def test_each_gradient_counted_once_before_its_reduction_and_grad_then_read_as_reduced():
    model, params = _model_after_backward()
    st, faults = StepState(), Faults()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, faults)
    local = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    tap((torch.ones(1),), {}, None)  # a metric the loop reduces: no gradient
    tap((torch.cat([params[i].grad.view(-1) for i in (0, 2)]),), {}, None)  # not in order
    for p in params:
        tap((p.grad.data,), {}, None)
        p.grad.data /= 4.0  # what the loop does after SUM
    tap((params[0].grad,), {"group": None}, None)  # reduced twice: counted once
    tap((), {"tensor": params[1].grad}, None)
    assert st.tapped_reductions == len(params) and not faults.counts
    # backward is over: the first reduction read every gradient in one pass
    assert len(st.local_sq) == 1 and math.isclose(float(st.local_sq[0]), local, rel_tol=1e-6)
    assert sum(st.nonfinite) == 0
    st.phase = "optimizer"
    assert fallback_grad_stats(st, params, fsdp=False, dtensor=False)
    assert math.isclose(float(st.reduced_sq[0]), local / 4.0, rel_tol=1e-6)  # not local again
    assert len(st.local_sq) == 1


def test_nan_in_a_local_gradient_is_counted_and_the_map_follows_new_gradients():
    model, params = _model_after_backward()
    st = StepState()
    tap = GradAllReduceTap(st, params, Faults())
    st.phase = "forward"  # a metric all-reduced before backward: map built early
    tap((torch.ones(1),), {}, None)
    for p in params:  # set_to_none, then a new backward: new gradient storage
        p.grad = None
    model(torch.randn(5, 4)).square().sum().backward()
    params[1].grad.view(-1)[0] = float("nan")
    st.phase = "backward"
    for p in params:
        tap((p.grad,), {}, None)
    assert st.tapped_reductions == len(params)
    assert sum(int(n) for n in st.nonfinite) == 1
    st.reset_for_next_step(0.0)  # the next step counts every gradient again
    st.phase = "backward"
    for p in params:
        tap((p.grad,), {}, None)
    assert st.tapped_reductions == len(params) and len(st.local_sq) == 1


def test_after_the_batched_read_only_whole_gradients_count_as_reduced():
    """The gradients the first reduction read are each counted once, when their own
    reduction comes; the first part of one (same storage, fewer elements) is not it."""
    model, params = _model_after_backward()
    st = StepState()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, Faults())
    tap((params[0].grad,), {}, None)  # backward over: every gradient read here
    tap((params[1].grad.view(-1)[:2],), {}, None)  # a slice from the gradient's start
    assert st.tapped_reductions == 1
    for p in params[1:]:
        tap((p.grad,), {}, None)
    tap((params[2].grad,), {}, None)  # twice: once
    assert st.tapped_reductions == len(params) and len(st.local_sq) == 1
    st.reset_for_next_step(0.0)  # a new step: read again, not taken as already read
    st.phase = "backward"
    tap((params[3].grad,), {}, None)
    assert st.tapped_reductions == 1 and len(st.local_sq) == 1  # read in this step


def test_a_flat_copy_of_every_gradient_is_the_local_gradient():
    model, params = _model_after_backward()
    st = StepState()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, Faults())
    flat = torch.cat([p.grad.view(-1) for p in params])
    local = float(torch.linalg.vector_norm(flat))
    tap((flat,), {}, None)
    tap((params[0].grad,), {}, None)  # all counted already
    tap((flat.clone(),), {}, None)
    assert st.tapped_reductions == 1 and math.isclose(float(st.local_sq[0]), local, rel_tol=1e-6)


def test_a_clip_after_the_reductions_is_the_reduced_norm_and_one_before_them_is_not():
    # the loop clipped its averaged gradients: that norm (before clipping, as with DDP)
    # is grad_norm_reduced, and no second pass over .grad is taken; a clip of local
    # gradients before their reduction is not the reduced norm
    for clip_after, reused in ((4, True), (2, False)):  # the model has 4 gradients
        model, params = _model_after_backward()
        st = StepState()
        st.phase = "backward"
        tap = GradAllReduceTap(st, params, Faults())
        for i, p in enumerate(params):
            tap((p.grad,), {}, None)
            if i + 1 == clip_after:  # what clip_patch.py records
                st.clip_norm, st.clip_taps = torch.tensor(7.5), st.tapped_reductions
        st.phase = "optimizer"
        assert fallback_grad_stats(st, params, fsdp=False, dtensor=False)
        got = float(st.reduced_sq[0])
        grads = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
        assert math.isclose(got, 7.5 if reused else grads, rel_tol=1e-6), clip_after


def test_many_gradients_norm_and_a_flipped_exponent_or_a_nan_still_shows():
    from rankscope.collectors.rank.grad_stats import grads_norm_stats

    torch.manual_seed(1)
    grads = [torch.randn(n) for n in (3, 300, 7)]
    want = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert math.isclose(grads_norm_stats(grads)[0], want, rel_tol=1e-6)
    grads[1][5] = 3e30  # squared, past float32's range: the float64 pass takes over
    total, nonfinite = grads_norm_stats(grads)
    assert math.isclose(total, 3e30, rel_tol=1e-6) and nonfinite == 0
    grads[2][0] = float("nan")
    total, nonfinite = grads_norm_stats(grads)
    assert math.isnan(total) and nonfinite == 1


def test_gradients_reduced_from_inside_backward_are_each_read_alone():
    # a loop that overlaps its reductions with backward (a hook per gradient): at the
    # first one the others are not computed yet, so no pass over them all
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    st = StepState()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, Faults())
    seen = []

    def reduce_now(p):
        seen.append(float(p.grad.square().sum()))
        tap((p.grad,), {}, None)
        p.grad.mul_(0.5)  # the reduction changes it in place

    for p in params:
        p.register_post_accumulate_grad_hook(reduce_now)
    model(torch.randn(5, 4)).square().sum().backward()
    assert st.tapped_reductions == len(params) and len(st.local_sq) == len(params)
    got = math.sqrt(sum(float(n) ** 2 for n in st.local_sq))
    assert math.isclose(got, math.sqrt(sum(seen)), rel_tol=1e-6)


def test_buckets_of_a_buffer_the_main_grads_are_views_of_are_read_by_storage():
    """Megatron-LM: ``.grad`` freed into ``main_grad`` views of one buffer; each bucket,
    a slice of it, read once; a bucket COPIED out of gradients is not one of them."""
    model, params = _model_after_backward()
    buf = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.main_grad = buf[off : off + p.numel()].view_as(p)
        p.main_grad.copy_(p.grad)
        p.grad = None
        off += p.numel()
    params[3].main_grad[0] = float("nan")
    st, faults = StepState(), Faults()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, faults)
    split = params[0].numel() + params[1].numel()
    first, second = buf[:split], buf[split:]
    tap((buf[1:split].clone(),), {}, None)  # a copy of no gradients' run
    assert st.tapped_reductions == 0 and not st.local_sq
    tap((second,), {}, None)  # backward makes the last layers' gradients first
    tap((first,), {}, None)
    tap((second,), {}, None)  # again: counted as a reduction, not read twice
    assert st.tapped_reductions == 3 and len(st.local_sq) == 2 and not faults.counts
    assert math.isclose(float(st.local_sq[1]), float(first.norm()), rel_tol=1e-6)
    assert [int(n) for n in st.nonfinite] == [1, 0]
    buf.div_(4.0)
    params[3].main_grad[0] = 0.0
    st.phase = "optimizer"
    assert fallback_grad_stats(st, params, fsdp=False, dtensor=False)  # through main_grad
    assert math.isclose(float(st.reduced_sq[0]), float(buf.norm()), rel_tol=1e-6)


def test_gradients_copied_in_order_into_a_reused_buffer_are_read_from_each_bucket():
    """fairseq's legacy ``all_reduce_and_rescale_tensors``: consecutive gradients copied
    into one preallocated buffer, each filled part all-reduced, then copied back."""
    model, params = _model_after_backward()  # sizes 12, 3, 6, 2
    params[2].grad.view(-1)[0] = float("inf")
    local = [p.grad.clone() for p in params]
    st, faults = StepState(), Faults()
    st.phase = "backward"
    tap = GradAllReduceTap(st, params, faults)
    buf = torch.zeros(16)
    for bucket in ([0, 1], [2, 3]):
        n = 0
        for i in bucket:
            k = params[i].grad.numel()
            buf[n : n + k].copy_(params[i].grad.view(-1))
            n += k
        tap((buf[:n],), {}, None)
        buf[:n].div_(4.0)  # the loop's rescale after SUM
        n = 0
        for i in bucket:
            k = params[i].grad.numel()
            params[i].grad.view(-1).copy_(buf[n : n + k])
            n += k
    assert st.tapped_reductions == 2 and not faults.counts
    first = torch.cat([g.view(-1) for g in local[:2]]).norm()
    assert math.isclose(float(st.local_sq[0]), float(first), rel_tol=1e-6)
    assert [int(n) for n in st.nonfinite] == [0, 1]  # the inf is the second bucket's
    st.reset_for_next_step(0.0)
    st.phase = "optimizer"  # after backward, before the step only
    tap((torch.ones(15),), {}, None)
    assert st.tapped_reductions == 0


def test_the_collective_wrappers_own_time_is_counted_and_the_norm_pass_apart(tmp_path):
    # self-timing left the wrappers of the loop's own collectives out: FSDP2's own time
    # read 70-90 us a step in the bench, 550 once counted (docs/collectors.md)
    import threading

    import torch.distributed as dist
    from rankscope.collectors import RankCollector

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="m", sink=f"file://{tmp_path}/trace")
    try:
        for _ in range(3):
            model(torch.randn(5, 4)).square().sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
        mine = rc.self_time
        other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(3)))
        other.start()
        other.join()
        after = rc.self_time
    finally:
        rc.close()
        dist.destroy_process_group()
    assert mine.collectives_s > 0 and mine.grad_norm_s > 0
    assert math.isclose(mine.overhead_s, mine.hooks_s + mine.comm_hook_s + mine.digest_s
                        + mine.collectives_s)  # fmt: skip
    assert after.collectives_s == mine.collectives_s  # not the training thread's time

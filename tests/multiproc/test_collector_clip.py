"""The loop's own ``clip_grad_norm_`` reused as the collector's gradient norm."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rankscope.collectors import RankCollector
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel
from rankscope.pipeline.traces.files import read_trace

WORLD, STEPS = 2, 5


def _steps(name: str, q: queue.Queue) -> list[dict]:
    unregister_channel(name)
    return [r for r in iter_channel(q) if r["type"] == "step"]


def test_plain_loop_that_clips_reports_the_clip_norm_and_restores_the_function():
    q: queue.Queue = queue.Queue()
    register_channel("clip-plain", q)
    original = torch.nn.utils.clip_grad_norm_
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="c", sink="embedded://clip-plain", rank=0, world=1)
    assert torch.nn.utils.clip_grad_norm_ is not original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
    seen, computed = [], []
    opt.register_step_pre_hook(  # what the collector would compute: the clipped grads
        lambda o, a, k: computed.append(
            float(
                torch.linalg.vector_norm(torch.cat([p.grad.view(-1) for p in model.parameters()]))
            )
        )
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=gen)).square().mean() * 100
        loss.backward()
        if step < 3:
            params = model.parameters() if step != 1 else [model[0].weight]  # a subset
            seen.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm=0.01)))
        opt.step()
        rc.loss(loss)
    rc.close()
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
    steps = _steps("clip-plain", q)
    norms = [r["grad_norm"] for r in steps]
    assert norms[0] == pytest.approx(seen[0], rel=1e-6)  # the loop's pre-clip norm
    assert norms[0] > 0.01 * 10 and computed[0] == pytest.approx(0.01, rel=1e-3)
    assert norms[1] == pytest.approx(computed[1], rel=1e-5)  # subset clip: not taken
    assert norms[2] == pytest.approx(seen[2], rel=1e-6)
    assert norms[3] == pytest.approx(computed[3], rel=1e-5)  # no clip: computed again
    assert all(r["nonfinite"] == 0 for r in steps)


def test_clip_from_another_thread_or_of_another_model_is_not_taken():
    q: queue.Queue = queue.Queue()
    register_channel("clip-thread", q)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rc = RankCollector.attach(model, opt, job="c", sink="embedded://clip-thread", rank=0, world=1)
    opt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    other = threading.Thread(
        target=lambda: torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(3))] * 2, 1.0)
    )
    other.start()
    other.join()
    twin = torch.nn.Linear(8, 1)  # another model, as many parameters
    twin(torch.ones(2, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert rc.state.clip_norm is None
    opt.step()
    rc.close()
    assert len(_steps("clip-thread", q)) == 1


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        rc = RankCollector.attach(ddp, opt, job="clip", sink=f"file://{tmp}/trace")
        gen = torch.Generator().manual_seed(10 + rank)
        log = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(
                ddp(torch.randn(8, 16, generator=gen)), torch.ones(8, 1)
            )
            loss.backward()
            own_passes = len(rc.state.reduced_sq)  # the hook's reduced-norm passes this step
            clip = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5))
            log.append({"clip": clip, "own_passes": own_passes})
            opt.step()
            rc.loss(loss)
        rc.close()
        spent = rc.self_time
        log.append(
            {
                f: getattr(spent, f)
                for f in ("steps", "comm_hook_s", "grad_norm_s", "launch_s", "digest_s", "hooks_s")
            }
        )
        Path(tmp, f"clip{rank}.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_ddp_loop_that_clips_gives_grad_norm_reduced_without_a_second_pass(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    trace = read_trace(tmp_path / "trace")
    logs = [json.loads((tmp_path / f"clip{r}.json").read_text()) for r in range(WORLD)]
    by = {(r["rank"], r["step"]): r for r in trace.records if r["type"] == "step"}
    for step in range(STEPS):
        reduced = [by[(r, step)]["grad_norm_reduced"] for r in range(WORLD)]
        local = [by[(r, step)]["grad_norm"] for r in range(WORLD)]
        assert reduced[0] == reduced[1] == pytest.approx(logs[0][step]["clip"], rel=1e-6)
        assert local[0] != local[1]  # the local norms still come from the buckets
        # the first step computes it too; once the loop is seen clipping, the hook skips it
        assert [lg[step]["own_passes"] > 0 for lg in logs] == [step == 0] * WORLD
    for lg in logs:  # the collector timed its own parts on the training thread
        spent = lg[STEPS]
        assert spent["steps"] == STEPS
        assert min(spent[k] for k in spent if k != "steps") > 0, spent

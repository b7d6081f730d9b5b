"""One rank of the Kafka end-to-end test: real gloo DDP training with the Kafka sink and
the control listener; writes what it saw to ``<out>/rank<N>.json``."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

HOSTS_OF = {0: "node00", 1: "node00", 2: "node01", 3: "node01"}


def train_rank(rank, world, rdzv, url, secret, out, steps, slow_rank, slow_from, slow_s):
    import torch
    import torch.distributed as dist
    from rankscope.collectors import RankCollector
    from rankscope.collectors.control.listener import ControlListenerConfig, RankEvicted
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    out = Path(out)
    host = HOSTS_OF[rank]
    result = {"rank": rank, "host": host, "evicted": None, "seen": [], "error": None}
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))  # fmt: skip
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    os.environ["RANKSCOPE_CONTROL_SECRET"] = secret  # how a launcher hands it to the ranks
    rc = RankCollector.attach(
        model, opt, job="train-e2e", sink=url + "&linger_ms=5", rank=rank, world=world,
        host=host, beat_interval_s=0.5,
        control=ControlListenerConfig(url=url, job="train-e2e", rank=rank, host=host),
    )  # fmt: skip
    listener = rc.control
    rc.on_action(
        lambda a: result["seen"].append(
            {"action": a.action, "hosts": list(a.hosts), "affects_me": a.affects_me}
        )
    )
    listener.ready.wait(60)
    (out / f"ready{rank}").touch()
    gen = torch.Generator().manual_seed(rank)
    step = -1
    try:
        for step in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if rank == slow_rank and step >= slow_from:
                time.sleep(slow_s)  # a slow GPU: compute takes longer on this rank
            loss.backward()
            rc.loss(loss.detach())
            opt.step()  # the step boundary: control actions run here
            time.sleep(0.03)
    except RankEvicted as exc:
        a = exc.action
        result["evicted"] = {"step": step, "hosts": list(a.hosts), "ranks": list(a.ranks),
                             "finding_id": a.finding_id}  # fmt: skip
    except Exception as exc:  # a peer left: the evicted ranks are gone
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        deadline = time.monotonic() + 10
        while not result["seen"] and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                listener.at_step_boundary(step + 1)  # let queued actions reach the callbacks
            except RankEvicted as evicted:
                result["evicted"] = {"step": step, "hosts": list(evicted.action.hosts)}
    result["steps_done"] = step
    result["rejected"] = dict(listener.rejected)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    try:
        rc.close()
        listener.close()
    finally:
        os._exit(0)  # peers may be gone: never wait on the process group at exit

"""One simulated rank: a real gloo DDP training process with faults and a collector.

The training loop is an ordinary DDP loop (zero_grad, forward, backward,
clip, optimizer step) with the rank collector attached in the documented
three lines; the faults reach into it only through hooks: module and
parameter-tensor hooks, optimizer post-hooks registered before the collector
attaches, and the DDP communication hook handed to ``attach``.

Besides the trace (which the collector writes), a rank tells the parent three
things on a small synchronous queue: that it finished a step (progress, used
to notice a hang), what a fault did (``injections`` in meta.json) and how it
ended. The parent can ask a rank to stop (a hang, or a crashed peer): a
watcher thread then flushes the collector and leaves with ``EXIT_STOPPED``,
even while the training thread is blocked in a collective.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rankscope.pipeline.simulate.device import DeviceClock
from rankscope.pipeline.simulate.faults import FaultContext, fault_class
from rankscope.pipeline.simulate.model import BatchSource, ModelConfig, TinyLM
from rankscope.pipeline.simulate.spec import FaultSpec
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["WorkerSpec", "worker_main", "EXIT_STOPPED", "EXIT_PEER_FAILED", "EXIT_ERROR"]

EXIT_STOPPED = 75  # asked to stop by the harness (hang or a peer's crash)
EXIT_PEER_FAILED = 76  # a collective failed (typically: a peer died)
EXIT_ERROR = 77  # anything else went wrong in this rank
_STOP_FLUSH_WAIT_S = 1.5  # > the collector's sink flush interval (1 s)


@dataclass(slots=True, kw_only=True)
class WorkerSpec:
    """Everything one rank process needs; picklable, built by the harness."""

    rank: int
    world: int
    job: str
    host: str
    topology: dict[str, int]
    steps: int
    seed: int
    sink: str
    rendezvous: str
    faults: list[FaultSpec] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    lr: float = 3e-3
    clip_norm: float = 1.0
    beat_interval_s: float = 1.0
    pg_timeout_s: float = 1800.0
    channel: str | None = None  # embedded channel name, when the sink is embedded


def _comm_hook_for(ctx: FaultContext, faults: list, world: int):
    """The DDP communication hook: plain averaging all-reduce with fault taps around it."""

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        for f in faults:
            f.before_all_reduce(ctx, bucket)
        buf = bucket.buffer()
        buf.div_(world)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def reduced(done: torch.futures.Future) -> torch.Tensor:
            tensor = done.value()[0]
            for f in faults:
                tensor = f.after_all_reduce(ctx, bucket, tensor)
            return tensor

        return fut.then(reduced)

    return hook


def _clip_or_skip(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the reduced gradient; when it is not finite, drop it so the step skips the update.

    This is what a mixed-precision scaler does with an overflowing step, and it
    keeps every rank stepping in lock-step. The norm is taken in float64 so
    that a huge-but-finite corrupted element does not overflow it.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))
    if not math.isfinite(total):
        for p in params:
            p.grad = None
        return total
    if total > max_norm:
        scale = max_norm / (total + 1e-12)
        for g in grads:
            g.mul_(scale)
    return total


def _start_stop_watcher(stop_conn, events, rank: int, records_q) -> None:
    """Leave when the harness asks (or dies), whatever the training thread is doing.

    ``stop_conn`` is the read end of a pipe whose only write end the harness
    holds: the harness closes it to stop every rank at once, and the OS
    closes it when the harness dies, so no rank outlives its harness.
    The collector is NOT closed: closing would emit an ``idle`` beat, while a
    job killed by a watchdog leaves its last beats saying where it was
    blocked. The collector's sender flushes its sink at least once a second,
    so waiting a little longer than that keeps every beat recorded so far.
    """

    def watch() -> None:
        try:
            stop_conn.recv()
        except (EOFError, OSError):
            pass
        time.sleep(_STOP_FLUSH_WAIT_S)
        if records_q is not None:
            _run_bounded(lambda: (records_q.close(), records_q.join_thread()))
        events.put(("exit", rank, EXIT_STOPPED, "stopped by the harness"))
        os._exit(EXIT_STOPPED)

    threading.Thread(target=watch, name="rankscope-sim-stop", daemon=True).start()


def _run_bounded(fn, timeout_s: float = 5.0) -> None:
    """Run a flush/close that might wait on a wedged peer, but never wait on it forever."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout=timeout_s)


def worker_main(ws: WorkerSpec, events, stop_conn, records_q=None) -> None:
    """Entry point of one rank process (``multiprocessing`` target)."""
    os.environ["RANKSCOPE_HOST"] = ws.host
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this (forked) process
        pass
    _start_stop_watcher(stop_conn, events, ws.rank, records_q)
    collector: list = []  # the attached collector, once there is one
    try:
        _train(ws, events, records_q, collector)
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the parent
        # A training program that fails exits through its atexit handlers,
        # which close the collector (flushing what it has); do the same.
        peer = isinstance(exc, (RuntimeError, dist.DistBackendError)) and _looks_like_peer(exc)
        code = EXIT_PEER_FAILED if peer else EXIT_ERROR
        if collector:
            _run_bounded(collector[0].close)
        if records_q is not None:
            _run_bounded(lambda: (records_q.close(), records_q.join_thread()))
        events.put(("exit", ws.rank, code, f"{type(exc).__name__}: {exc}"[:500]))
        os._exit(code)
    events.put(("exit", ws.rank, 0, "completed"))


def _looks_like_peer(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(
        w in text for w in ("connection", "peer", "gloo", "closed", "reset", "timeout", "broken")
    )


def _train(ws: WorkerSpec, events, records_q, collector: list) -> None:
    from rankscope.collectors import RankCollector

    dist.init_process_group(
        "gloo",
        init_method=f"file://{ws.rendezvous}",
        rank=ws.rank,
        world_size=ws.world,
        timeout=datetime.timedelta(seconds=ws.pg_timeout_s),
    )
    torch.manual_seed(ws.seed)  # identical initial weights (DDP broadcasts them anyway)
    model = TinyLM(ws.model)
    ddp = DDP(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=ws.lr)
    ctx = FaultContext(
        rank=ws.rank,
        world=ws.world,
        host=ws.host,
        steps=ws.steps,
        seed=ws.seed,
        model=model,
        optimizer=optimizer,
        report=lambda info: events.put(("fault", ws.rank, info)),
    )
    ctx.extra["device"] = DeviceClock(
        model, us_per_token=ws.model.device_us_per_token, step_fn=lambda: ctx.step
    )
    ctx.extra["device"].watch_optimizer(optimizer)  # first: before the collector's hooks
    faults = [fault_class(spec.kind)(spec) for spec in ws.faults]
    for f in faults:
        f.install(ctx)  # before attach: their optimizer hooks run before the collector's
    if records_q is not None:
        from rankscope.collectors.sinks.embedded import register_channel

        register_channel(ws.channel, records_q)
    rc = RankCollector.attach(
        ddp,
        optimizer,
        job=ws.job,
        sink=ws.sink,
        topology=ws.topology,
        host=ws.host,
        rank=ws.rank,
        world=ws.world,
        comm_hook=_comm_hook_for(ctx, faults, ws.world),
        beat_interval_s=ws.beat_interval_s,
    )
    collector.append(rc)
    ctx.extra["collector"] = rc  # for faults that attach more collectors (e.g. gpu)
    data = BatchSource(ws.model, ws.seed, ws.rank)
    params = [p for p in ddp.parameters() if p.requires_grad]
    vocab = ws.model.vocab
    events.put(("ready", ws.rank, time.time()))
    for step in range(ws.steps):
        ctx.step = step
        inputs, targets = data.next()
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        _clip_or_skip(params, ws.clip_norm)
        rc.loss(loss.detach())
        optimizer.step()  # the collector's post-hook closes the step here
        events.put(("step", ws.rank, step))
    for f in faults:
        f.close(ctx)
    rc.close()
    dist.barrier()
    dist.destroy_process_group()

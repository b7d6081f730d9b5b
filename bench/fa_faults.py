"""Faults injected from OUTSIDE the loop: hooks and a comm hook the launcher adds.

The loops in ``fa_loops.py`` / ``fa_sharded.py`` know nothing of faults; a
fault is a dict (``kind``, ``rank``, ``from`` and its own keys) installed on
the loop's model and optimizer before the collector attaches (so an optimizer
post-hook's flip is already in that step's digest). A slow link is a DDP
communication hook handed to ``RankCollector.attach(comm_hook=...)`` under
DDP; under FSDP2 (no comm hooks) it wraps ``torch.distributed``'s
``reduce_scatter_single``, which FSDP2 calls by name, before the collector
wraps it in turn. ``label()`` writes the ground truth in the trace format's
``labels.jsonl`` terms.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import torch
import torch.distributed as dist
from fa_held import Board, HeldSleep
from fa_neighbour import install_neighbour

__all__ = ["install_fault", "comm_hook_for", "label"]

KINDS = {"straggler": "straggler", "sdc-param": "sdc", "nonfinite": "nonfinite",
         "network": "network", "neighbour": "straggler"}  # fmt: skip


class StepClock:
    """The step in progress, read from the collector once it is attached."""

    def __init__(self) -> None:
        self.rc: Any = None

    def __call__(self) -> int:
        return self.rc.step_index if self.rc is not None else -1


def _active(fault: dict, step: int) -> bool:
    until = fault.get("until")
    return step >= fault["from"] and (until is None or step <= until)


def _own_compute(clock: StepClock, split: bool = True) -> float | None:
    """This step's compute so far (optimizer post-hooks only): with ``split``, the
    record's (``pending_record``: a stage's receive before its first forward is not
    in the span, DDP's wait for its last buckets is comm); without, the time from
    the first forward less ``comm_s``, what every sleep-mode corpus was sized by."""
    st = clock.rc.state if clock.rc is not None else None
    if st is None or st.first_forward_perf is None:
        return None
    comm = st.comm_s
    if split:
        comm += st.backward_wait_s() - st.comm_before_forward_s
    return max(0.0, time.perf_counter() - st.first_forward_perf - comm)


def _straggler(fault: dict, model: torch.nn.Module, opt, clock: StepClock,
               board: Board | None = None, key: int = 0) -> None:  # fmt: skip
    """Sleep ``factor - 1`` times this rank's own clean compute, in the forward pass.

    The clean compute is the median over the steps before the fault of the
    time from the step's first forward to its update, less the time spent in
    communication (the collector's step state; ``_own_compute``). Stretching
    the current step's forward by its
    own length instead undershoots on an oversubscribed host: while the rank
    sleeps, its peers get the cores. A ``hold`` fault (``fa_held.py``) then
    steers the sleep so that its compute stays ``factor`` x its peers'.
    """
    extra = fault["factor"] - 1.0
    slept: list[int] = []
    clean: list[float] = []
    held = HeldSleep(fault["factor"]) if fault.get("hold") and board is not None else None

    def fwd_post(mod, args, out):
        step = clock()
        if _active(fault, step) and clean and step not in slept:
            slept.append(step)
            mid = sorted(clean)[len(clean) // 2]
            if held is not None:
                held.start(mid)
            time.sleep(held.sleep_s if held is not None else extra * mid)

    def post(optimizer, a, kw):  # runs before the collector's post-hook: state is this step's
        own = _own_compute(clock, split=held is not None)
        if own is None or clock() < 1:
            return
        if clock() < fault["from"]:
            clean.append(own)
        if held is not None:
            held.seen(board.peers(key))
            if _active(fault, clock()) and clock() in slept:
                held.steer(own)

    for part in model if isinstance(model, torch.nn.ModuleList) else [model]:  # pp stages
        part.register_forward_hook(fwd_post)
    opt.register_step_post_hook(post)


def _post_compute(opt, clock: StepClock, board: Board, key: int) -> None:
    """Every rank of a held straggler's run posts its compute of each step."""

    def post(optimizer, a, kw):
        own = _own_compute(clock)
        if own is not None and clock() >= 1:
            board.post(key, own)

    opt.register_step_post_hook(post)


def _largest(model: torch.nn.Module) -> torch.Tensor:
    return max(model.parameters(), key=lambda p: p.numel())


def _flip_bit(value: float, bit: int) -> float:
    (word,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", word ^ (1 << bit)))[0]


def _sdc_param(fault: dict, model, opt, clock: StepClock) -> None:
    """Flip one mantissa bit of one weight right after the faulty step's update."""
    p = _largest(model)
    idx = fault.get("index", 7) % p.numel()

    def post(optimizer, args, kwargs):
        if clock() == fault["from"]:
            with torch.no_grad():
                flat = p.view(-1)
                flat[idx] = _flip_bit(float(flat[idx]), fault.get("bit", 22))

    opt.register_step_post_hook(post)


def _nonfinite(fault: dict, model, clock: StepClock) -> None:
    """One element of this rank's LOCAL gradient becomes NaN in the faulty step."""
    p = _largest(model)

    def hook(grad):
        if clock() == fault["from"]:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    p.register_hook(hook)


def _nonfinite_output(fault: dict, model, clock: StepClock) -> None:
    """Sharded parameters' gradients are reduced inside FSDP before any hook of
    theirs: here one logit of the output layer becomes NaN in the faulty step
    (so the rank's loss and its local gradients are non-finite)."""
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]

    def poison(module, args, out):
        if clock() != fault["from"]:
            return None
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out

    head.register_forward_hook(poison)


def _slow_collective(fault: dict, clock: StepClock, name: str):
    """This rank's first ``torch.distributed.<name>`` call of each faulty step returns
    ``delay_s`` late: FSDP2's gradient reduce-scatter (``reduce_scatter_single``), or
    the all-reduce over a stage's replicas under pipelining."""
    orig = getattr(dist, name)
    slowed: list[int] = []

    def slow(*args, **kwargs):
        out = orig(*args, **kwargs)
        step = clock()
        if _active(fault, step) and step not in slowed:
            slowed.append(step)
            time.sleep(fault["delay_s"])
        return out

    setattr(dist, name, slow)

    def undo() -> None:
        if getattr(dist, name) is slow:
            setattr(dist, name, orig)

    return undo


def install_fault(fault: dict | None, rank: int, loop, clock: StepClock,
                  board: Board | None = None, key: int = 0, world: int = 4):  # fmt: skip
    """Install ``fault`` on ``loop`` when it is this rank's (after ``loop.wrap()``,
    before ``RankCollector.attach``); returns what undoes it (after ``close``).
    ``board``: the run's compute board (``fa_held.py``) when it holds a straggler;
    every rank posts to it, ``key`` its peer group's. A noisy neighbour pins every
    rank to its own core (``fa_neighbour.py``)."""
    if board is not None:
        _post_compute(loop.opt, clock, board, key)
    if fault is not None and fault["kind"] == "neighbour":
        return install_neighbour(fault, rank, world, loop.model, clock)
    if fault is None or fault["rank"] != rank:
        return lambda: None
    kind = fault["kind"]
    if kind not in loop.faults:
        raise ValueError(f"fault {kind!r} is not localizable under loop style {loop.style!r}")
    if kind == "straggler":
        _straggler(fault, loop.model, loop.opt, clock, board, key)
    elif kind == "sdc-param":
        _sdc_param(fault, loop.model, loop.opt, clock)
    elif kind == "nonfinite":
        nan_in_grad = getattr(loop, "nan_in_grad", loop.ddp)  # else sharded: poison the output
        (_nonfinite if nan_in_grad else _nonfinite_output)(fault, loop.model, clock)
    elif kind == "network" and not loop.ddp:
        return _slow_collective(fault, clock, loop.reduce_op)
    elif kind != "network":
        raise ValueError(f"unknown fault kind {kind!r}")
    return lambda: None


def comm_hook_for(fault: dict | None, rank: int, world: int, clock: StepClock, ddp: bool = True):
    """A plain averaging all-reduce hook; a slow link completes ``delay_s`` late here.

    The sleep runs in the reduction's completion callback (the comm thread),
    so this rank's later buckets and next step start late: peers wait for it.
    """
    if not ddp or fault is None or fault["kind"] != "network" or fault["rank"] != rank:
        return None
    delay = fault["delay_s"]

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(world)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            if _active(fault, clock()):
                time.sleep(delay)
            return f.value()[0]

        return fut.then(done)

    return hook


def label(fault: dict | None, host: str, ranks: list[int] | None = None) -> list[dict]:
    """``labels.jsonl`` lines for a run (none for a clean run); ``ranks``: whom the
    fault is to be blamed on, when that is more than its rank (a tp group)."""
    if fault is None:
        return []
    kind = KINDS[fault["kind"]]
    one_shot = fault["kind"] == "nonfinite"
    lab = {
        "kind": kind,
        "ranks": ranks or [fault["rank"]],
        "hosts": [host],
        "step": fault["from"],
        "until": fault["from"] if one_shot else fault.get("until"),
        "note": f"bench_false_alarms {fault}",
    }
    mag = fault.get("factor", fault.get("delay_s"))
    if mag is not None:
        lab["magnitude"] = mag
    return [lab]

"""A noisy neighbour: another process starts sharing one rank's CPU core.

Nothing in the rank is slow; its host lends its core to someone else. Every
rank of the run is pinned to a core of its own for the whole run (all its
threads: gloo's and the collector's too), so the clean part of the run has
no rank crowding another. From the fault's step on (its first forward), a busy process pinned to
the faulty rank's core competes for it at a nice level chosen so that the
rank keeps about ``1 / factor`` of the core (Linux's CFS weights: nice 0
halves it, 2x; nice 3, 1.5x; nice 6, 1.27x). The rank's thread then waits
for its core: ``cpu_wait_s`` grows with ``compute_s`` (docs/detectors.md,
``own_time.py``), which is what the detectors see of a neighbour.

Needs a core per rank (``--world 2`` on this 2-core host). The busy process
exits by itself when the rank's process is gone (it polls its parent).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

__all__ = ["MARK", "NICE_WEIGHT", "install_neighbour", "nice_for", "pin_all_threads"]

MARK = "rankscope bench: a noisy neighbour"  # the busy process's first line

# CFS's weight per nice level (kernel/sched/core.c's sched_prio_to_weight), 0..10
NICE_WEIGHT = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110)

_HOG = """# rankscope bench: a noisy neighbour
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
os.nice(int(sys.argv[2]))
parent, n = os.getppid(), 0
while True:
    n += 1
    if n % 200000 == 0 and os.getppid() != parent:
        break
"""


def nice_for(factor: float) -> int:
    """The nice level at which a busy neighbour slows a rank on its core by ``factor``
    (the rank keeps 1024 / (1024 + w) of it: w = (factor - 1) x 1024)."""
    want = (factor - 1.0) * NICE_WEIGHT[0]
    return min(range(len(NICE_WEIGHT)), key=lambda n: abs(NICE_WEIGHT[n] - want))


def pin_all_threads(cpu: int) -> set[int]:
    """Pin every thread of this process to ``cpu``; returns the affinity it had."""
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            pass
    return before


def _unpin(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def install_neighbour(fault: dict, rank: int, world: int, model: Any, clock: Any):
    """Pin this rank to its core; on the faulty rank, start the neighbour as the
    fault's step begins (a forward pre-hook). Returns what stops it and unpins."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world:
        raise ValueError(f"a noisy-neighbour fault needs a core per rank: {len(cpus)} "
                         f"cores for {world} ranks")  # fmt: skip
    cpu = cpus[rank]
    before = pin_all_threads(cpu)
    procs: list[subprocess.Popen] = []

    def pre(module, args):
        if fault["rank"] == rank and clock() >= fault["from"] and not procs:
            nice = str(nice_for(fault["factor"]))
            procs.append(subprocess.Popen([sys.executable, "-c", _HOG, str(cpu), nice]))
            pin_all_threads(cpu)  # threads the collector started after the pinning

    handle = model.register_forward_pre_hook(pre)

    def undo() -> None:
        handle.remove()
        for p in procs:
            p.kill()
            p.wait()
        _unpin(before)

    return undo

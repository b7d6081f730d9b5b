"""Computing ``param_digest`` off the training thread, when a core is free for it.

The digest reads every parameter byte once; on the training thread that is
the largest cost the collector has after the gradient norm. Its kernels
(numpy on CPU, torch on an accelerator) release the GIL, so the read can
overlap the next step's data loading, forward and backward (and, on a CPU
job, the waits for the gradient all-reduce) on a background thread. The rule
that keeps it correct: the digest must read the parameters as the optimizer
step left them, so it starts at the step boundary (the optimizer post-hook,
after any post-hook registered before attach) and the training thread joins
it before the next optimizer step (its pre-hook) mutates them.

The join never waits for a worker that has not started: a job is claimed by
whichever thread gets to it first. When the worker was not scheduled before
the next optimizer step (all cores busy, as when CPU ranks fill the host),
the training thread takes the job over and digests inline, which costs what
an inline digest costs and no more; when the worker is part way through, the
join waits for the rest of one read. ``stolen`` and ``waited_s`` count both.

Something else may change the parameters in between (a weight clamp after
``optimizer.step()``, ``load_state_dict``, a second optimizer). The worker
snapshots the parameters' version counters before reading and compares them
after; if any moved, the read may be torn, so it reads again (up to three
times), now digesting the parameters as that change left them. Changes
made through ``.data`` do not move version counters and are not seen: a loop
that does that between steps should set ``digest_in_background=False``.

One job is in flight at a time. A job that the worker could not finish (it
died, or it starved past the timeout) yields no digest: the record goes out
without ``param_digest`` rather than with a wrong one.
"""

from __future__ import annotations

import logging
import threading
import time
from queue import SimpleQueue

import torch
from rankscope.collectors.rank.digest import DigestPlan, digest_hex

__all__ = ["DigestJob", "DigestWorker", "InlineDigest", "make_digester"]

log = logging.getLogger("rankscope.collectors")

_RETRIES = 3
_RESOLVE_TIMEOUT_S = 5.0


class DigestJob:
    """One step's digest: filled by the worker, hashed by the sender thread.

    Completion is a lock held from creation until the job is done: ten
    times cheaper to create on the training thread than a ``threading.Event``.
    ``claim`` is taken, without waiting, by the one thread that computes it.
    """

    __slots__ = ("_lock", "claim", "stacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.claim = threading.Lock()
        self.stacks: list[torch.Tensor] | None = None

    def set_done(self) -> None:
        self._lock.release()

    def wait(self, timeout_s: float) -> bool:
        """True once the worker is done with this job (at most ``timeout_s`` of waiting)."""
        if self._lock.acquire(timeout=timeout_s):
            self._lock.release()
            return True
        return False

    def __call__(self) -> str:
        """The hex digest (sender thread); raises if the worker did not deliver."""
        if not self.wait(_RESOLVE_TIMEOUT_S) or self.stacks is None:
            raise RuntimeError("param digest not computed")
        return digest_hex(self.stacks)


class DigestWorker:
    """A daemon thread running ``DigestPlan.sums`` for one job at a time."""

    def __init__(self, params: list[torch.Tensor], name: str = "rankscope-digest") -> None:
        self._params = params
        self._plan = DigestPlan(params)
        self._jobs: SimpleQueue = SimpleQueue()
        self._current: DigestJob | None = None
        self.waited_s = 0.0  # training-thread time spent in join() waiting for the worker
        self.waits = 0  # joins that had to wait for a read in progress
        self.stolen = 0  # jobs the training thread digested itself (worker not started)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self) -> DigestJob:
        """Queue a digest of the parameters as they are now (training thread, ~µs)."""
        self.join()
        job = DigestJob()
        self._current = job
        self._jobs.put(job)
        return job

    def join(self) -> None:
        """Finish the job in flight, if any (training thread, before params change):
        take it over if the worker has not started it, else wait for the worker."""
        job, self._current = self._current, None
        if job is None or job.wait(0.0):
            return
        if job.claim.acquire(blocking=False):
            self.stolen += 1
            try:
                job.stacks = self._plan.sums()  # nothing changes the parameters meanwhile
            except Exception as exc:
                log.debug("param digest failed: %s", exc)
            finally:
                job.set_done()
            return
        t0 = time.perf_counter()
        if not job.wait(_RESOLVE_TIMEOUT_S):
            log.debug("param digest still running after %.0f s", _RESOLVE_TIMEOUT_S)
        self.waited_s += time.perf_counter() - t0
        self.waits += 1

    def close(self) -> None:
        """Finish the job in flight and stop the thread (bounded waits)."""
        self.join()
        self._jobs.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        params = self._params
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.claim.acquire(blocking=False):
                continue  # the training thread took it over
            try:
                for _ in range(_RETRIES):
                    before = [p._version for p in params]
                    stacks = self._plan.sums()
                    if before == [p._version for p in params]:
                        job.stacks = stacks
                        break
            except Exception as exc:
                log.debug("param digest failed: %s", exc)
            finally:
                job.set_done()


class InlineDigest:
    """The same interface, digesting on the calling (training) thread at ``start``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._plan = DigestPlan(params)

    def start(self):
        stacks = self._plan.sums()
        return lambda: digest_hex(stacks)

    def join(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_digester(params: list[torch.Tensor], *, background: bool | None, name: str):
    """A ``DigestWorker`` or an ``InlineDigest``; ``background=None`` picks the worker
    only when a parameter lives on an accelerator (``CollectorConfig``)."""
    if background is None:
        background = any(p.device.type != "cpu" for p in params)
    return DigestWorker(params, name=name) if background else InlineDigest(params)

"""The rank collector: per-step telemetry from an unchanged training loop.

``RankCollector.attach(model, optimizer, job=..., sink=...)`` finds the wrappers
(``wrappers.py``), hooks the optimizer step as the step boundary and never
raises into training: a failure of its own code is counted per part and said
once at WARNING (``faults.py``). Where each field is taken and what it costs:
docs/collectors.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Any

import torch
from rankscope.collectors.rank.beat import BeatThread
from rankscope.collectors.rank.config import CollectorConfig
from rankscope.collectors.rank.ddp_hook import HookContext, install_ddp_hook
from rankscope.collectors.rank.device_timing import DeviceTiming, TimingStats, make_device_timing
from rankscope.collectors.rank.digest_worker import make_digester
from rankscope.collectors.rank.faults import Faults
from rankscope.collectors.rank.grad_fallback import fallback_grad_stats
from rankscope.collectors.rank.host_copy import offload_record
from rankscope.collectors.rank.patches import Patches, build_patches
from rankscope.collectors.rank.self_time import SelfTime
from rankscope.collectors.rank.step_boundary import Guarded, count_tokens, pending_record
from rankscope.collectors.rank.step_record import build_step_record
from rankscope.collectors.rank.step_state import StepState
from rankscope.collectors.rank.topology import Identity, resolve_identity
from rankscope.collectors.rank.wrappers import (
    LoopShape,
    hookable_optimizer,
    inspect_model,
    resumed_step,
    stage_parts,
)
from rankscope.collectors.sinks.factory import make_sink
from rankscope.collectors.sinks.sender import Sender, SenderStats

__all__ = ["RankCollector"]

log = logging.getLogger("rankscope.collectors")


class RankCollector:
    """One rank's collector: hooks in, records out through a never-blocking sender."""

    def __init__(
        self,
        *,
        job: str,
        identity: Identity,
        sender: Sender,
        config: CollectorConfig,
        params: list[torch.Tensor],
        control: Any = None,
        shape: LoopShape | None = None,
    ) -> None:
        self.job = job
        self.identity = identity
        self.config = config
        self.control = control  # evict/recover channel; wired by the control-plane code
        self._sender = sender
        self._params = params
        self._shape = shape
        self._faults = Faults()
        self.state = StepState()
        self._self_time = SelfTime()
        self._handles: list[Any] = []
        self._hook_ctx: HookContext | None = None
        self._patches = Patches()  # what is patched into torch (patches.py)
        self._timing: DeviceTiming | None = make_device_timing(config, params)  # on CUDA
        self._beat: BeatThread | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._digester: Any = None  # digest_worker.DigestWorker or InlineDigest
        self._pending: dict | None = None
        self._boundaries = 0  # step boundaries taken (the AMP patch tells skipped steps)
        self._tokens_reported = False
        self._closed = False
        self._close_lock = threading.Lock()
        base = {  # the fields of every step record of this rank (schema.records.StepRecord)
            "job": job,
            "rank": identity.rank,
            "world": identity.world,
            "host": identity.host,
        }
        base.update(identity.coords)
        if shape is not None and shape.layout is not None and shape.layout.shard is not None:
            base["shard"] = shape.layout.shard  # replicas are the dp peers of equal shard
        self._base = base

    # ------------------------------------------------------------------ attach

    @classmethod
    def attach(
        cls,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        job: str,
        sink: Any,
        topology: Any = None,
        host: str | None = None,
        rank: int | None = None,
        world: int | None = None,
        comm_hook: Any = None,
        comm_state: Any = None,
        beat_interval_s: float | None = None,
        queue_size: int | None = None,
        control: Any = None,
        config: CollectorConfig | None = None,
        start_step: int | None = None,
    ) -> RankCollector:
        """Attach to ``model`` (a module, wrapped or not, or a pipeline rank's list of
        stages) and ``optimizer``; start beating.

        Raises ``ValueError`` with a clear message for what can be known to be
        wrong now (a bad sink URL, a topology that does not fit the world); after
        that nothing the collector does raises into training. ``start_step``: the
        first step's number (default: where a restored optimizer left off).
        """
        if not job or not isinstance(job, str):
            raise ValueError("RankCollector.attach: job must be a non-empty string")
        cfg = config or CollectorConfig()
        overrides = {k: v for k, v in (("beat_interval_s", beat_interval_s),
                                        ("queue_size", queue_size)) if v is not None}  # fmt: skip
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        try:
            model, parts = stage_parts(model)
            if optimizer is not None:
                optimizer = hookable_optimizer(optimizer)
        except ValueError as exc:
            raise ValueError(f"RankCollector.attach: {exc}") from None
        params = list(model.parameters())
        shape = inspect_model(model, params)
        params = [p for p in params if id(p) not in shape.private]  # the replicated ones
        try:
            ident = resolve_identity(
                rank=rank,
                world=world,
                host=host,
                topology=topology,
                dp_groups=shape.dp_groups,
                mesh=shape.mesh,
            )
        except ValueError as exc:
            raise ValueError(f"RankCollector.attach: {exc}") from None
        is_ddp = shape.ddp
        if comm_hook is not None and not is_ddp:
            raise ValueError("RankCollector.attach: comm_hook given but the model is not DDP")
        try:
            sink_obj = make_sink(sink)
        except ValueError as exc:
            raise ValueError(f"RankCollector.attach: bad sink {sink!r}: {exc}") from None
        sender = Sender(
            sink_obj,
            queue_size=cfg.queue_size,
            batch_max_records=cfg.batch_max_records,
            flush_interval_s=cfg.flush_interval_s,
            send_interval_s=cfg.send_interval_s,
            name=f"rankscope-sender-{ident.rank}",
        )
        rc = cls(
            job=job,
            identity=ident,
            sender=sender,
            config=cfg,
            params=params,
            control=control,
            shape=shape,
        )
        rc.state.step = resumed_step(optimizer) if start_step is None else int(start_step)
        try:
            rc._install(model, parts, optimizer, is_ddp, comm_hook, comm_state)
            rc._start_control()
        except Exception:
            rc.close()
            raise
        return rc

    def _install(self, model, parts, optimizer, is_ddp: bool, comm_hook, comm_state) -> None:
        st = self.state
        for part in parts:  # the model, or each pipeline stage this rank holds
            self._handles.append(part.register_forward_pre_hook(self._on_forward_pre,
                                                                with_kwargs=True))  # fmt: skip
            self._handles.append(part.register_forward_hook(self._on_forward_post))
        ddp_model = getattr(model, "_orig_mod", model)  # under a torch.compile wrapper
        if is_ddp:
            ctx = HookContext(
                st,
                self.config.ddp_group_name,
                comm_hook,
                comm_state,
                getattr(ddp_model, "process_group", None),
            )
            if install_ddp_hook(ddp_model, ctx):  # else DDP has one: .grad is reduced
                ctx.self_time, ctx.timing = self._self_time, self._timing
                self._hook_ctx = ctx
        if self.config.digest_every_steps and (self._shape is None or self._shape.digest):
            self._digester = make_digester(
                self._params,
                background=self.config.digest_in_background,
                name=f"rankscope-digest-{self.identity.rank}",
            )
        if optimizer is not None:
            self._optimizer = optimizer
            self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_pre))
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_post))
        self._patches = build_patches(
            self, optimizer, self._on_skipped_step, lambda: self._boundaries
        )
        for patch in self._patches.all:
            patch.install()
        st.step_start_perf = time.perf_counter()
        st.run_wait_start = st.run_queue.read()
        st.phase = "data"
        me, cfg = self.identity, self.config
        self._beat = BeatThread(state=st, job=self.job, rank=me.rank, host=me.host,
                                interval_s=cfg.beat_interval_s, emit=self._sender.put)  # fmt: skip
        self._beat.start()
        atexit.register(self.close)

    # ------------------------------------------------------------- public API

    @property
    def step_index(self) -> int:
        """The optimizer step in progress (0 for the first one)."""
        return self.state.step

    @property
    def self_time(self) -> SelfTime:
        """A snapshot of what the collector's own code has cost the training thread
        (cumulative seconds by part, ``collectors/rank/self_time.py``)."""
        return self._self_time.copy()

    @property
    def device_timing(self) -> TimingStats | None:
        """What became of the steps' CUDA timing events (None: CPU times only)."""
        return None if self._timing is None else self._timing.stats

    @property
    def faults(self) -> dict[str, int]:
        """Failures of the collector's own code by part (each said once at WARNING)."""
        return self._faults.snapshot()

    def note_failure(self, part: str, exc: BaseException) -> None:
        """Count a failure of an integration's own hook in ``rc.faults`` (said once)."""
        self._faults.hit(part, exc)

    @property
    def stats(self) -> SenderStats:
        """Sender counters: enqueued, sent, dropped (queue full / failed sends), errors."""
        return self._sender.stats

    def loss(self, value: Any) -> None:
        """Report this rank's loss for the step in progress (or the one that just ended)."""
        t0 = time.perf_counter()
        try:
            value = value.detach() if isinstance(value, torch.Tensor) else value
            if self._pending is not None:
                self._pending["loss"] = value
                self._emit_pending()
            else:
                self.state.loss = value
        except Exception as exc:
            self._faults.hit("loss()", exc)
        self._self_time.hooks_s += time.perf_counter() - t0

    def tokens(self, count: int) -> None:
        """Report the tokens of the step in progress (overrides the count taken from
        the integer inputs of ``forward``; e.g. when the model takes embeddings)."""
        try:
            self.state.tokens = int(count)
            self._tokens_reported = True
        except Exception as exc:
            self._faults.hit("tokens()", exc)

    def step(self, loss: Any = None) -> None:
        """Mark a step boundary (loops without an optimizer hook); with an optimizer
        attached it only reports the loss, the optimizer hook marks the boundary."""
        if self._closed:
            return
        if loss is not None:
            self.loss(loss)
        if self._optimizer is not None:
            return
        t0 = time.perf_counter()
        try:
            self._fallback_grad_stats()
            self._boundary()
        except Exception as exc:
            self._faults.hit("step()", exc)
        self._control_boundary(t0)

    def close(self) -> None:
        """Detach, emit what is pending, drain the sender (bounded wait). Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            atexit.unregister(self.close)
            self.state.phase = "idle"
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self._hook_ctx is not None:
                self._hook_ctx.active = False
            for patch in self._patches.all:
                patch.uninstall()
            if self._beat is not None:
                self._beat.stop()
            if self._digester is not None:
                self._digester.close()
            if callable(getattr(self.control, "close", None)):
                self.control.close()
            self._emit_pending()
            self.state.run_queue.close()
        except Exception as exc:
            self._faults.hit("close() bookkeeping", exc)
        if not self._sender.close(self.config.close_timeout_s):
            log.warning(
                "rankscope collector: sink still stalled at close; %d records abandoned",
                self._sender.pending(),
            )

    def __enter__(self) -> RankCollector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks

    def _on_forward_pre(self, module, args, kwargs) -> None:
        t0 = time.perf_counter()
        try:
            st = self.state
            if self._pending is not None:
                self._emit_pending()
            if self._optimizer is None and self._digester is not None:
                self._join_digest()  # rc.step() loops: the optimizer runs after backward
            if st.first_forward_perf is None:
                st.first_forward_perf = time.perf_counter()
                st.comm_before_forward_s = st.comm_s  # not input: data_s leaves it out
                if self._timing is not None:
                    self._timing.step_begin()
            if not self._tokens_reported:
                count_tokens(st, args, kwargs)
            st.phase = "forward"
        except Exception as exc:
            self._faults.hit("forward pre-hook", exc)
        self._self_time.hooks_s += time.perf_counter() - t0

    def _on_forward_post(self, module, args, output) -> None:
        # From here until backward ends the rank is in backward (the loss
        # computation in between is counted with it): cheaper than a tensor
        # hook on the output, and enough to tell forward from backward.
        self.state.phase = "backward"

    def _on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        try:
            self.state.phase = "optimizer"
            if self._digester is not None:
                self._join_digest()  # the step is about to change the parameters
            self._fallback_grad_stats()
        except Exception as exc:
            self._faults.hit("optimizer pre-hook", exc)
        self._self_time.hooks_s += time.perf_counter() - t0

    def _on_optimizer_post(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        try:
            self._boundary()
        except Exception as exc:
            self._faults.hit("optimizer post-hook", exc)
        self._control_boundary(t0)

    def _on_skipped_step(self) -> None:
        """AMP skipped the optimizer step: the iteration still is a step, marked skipped."""
        t0 = time.perf_counter()
        try:
            self.state.phase = "optimizer"
            if self._digester is not None:
                self._join_digest()
            self._boundary(skipped=True)
        except Exception as exc:
            self._faults.hit("skipped step", exc)
        self._control_boundary(t0)

    def _join_digest(self) -> None:
        """Join the digest in flight; its time is the digest's, not the hook's."""
        t0 = time.perf_counter()
        self._digester.join()
        spent = time.perf_counter() - t0
        self._self_time.digest_s += spent
        self._self_time.hooks_s -= spent

    # ------------------------------------------------------- control channel

    def on_action(self, callback: Any, *, immediate: bool = False) -> None:
        """Call ``callback(ControlAction)`` for every accepted evict/recover message of
        this job (who acts and when: ``collectors/control/listener.py``)."""
        if self.control is None:
            raise ValueError("RankCollector.on_action: attach with control=... first")
        self.control.on_action(callback, immediate=immediate)

    def _start_control(self) -> None:
        if self.control is not None:
            from rankscope.collectors.control.listener import start_listener

            self.control = start_listener(
                self.control, job=self.job, rank=self.identity.rank, host=self.identity.host
            )

    def _control_boundary(self, t0: float) -> None:
        """May raise ``RankEvicted``: the one exception the collector raises into training,
        on purpose (evict policy ``raise``); nothing else escapes ``at_step_boundary``.
        Closes the step's self-timing that began at ``t0``."""
        spent = self._self_time
        spent.steps += 1
        try:
            if self.control is not None:
                self.control.at_step_boundary(self.state.step)
        finally:
            spent.hooks_s += time.perf_counter() - t0

    # ------------------------------------------------------------ the record

    def _fallback_grad_stats(self) -> None:
        """Norms from ``.grad`` where no DDP bucket showed them (``grad_fallback.py``)."""
        t0 = time.perf_counter()
        shape = self._shape
        try:
            read = fallback_grad_stats(
                self.state,
                self._params,
                fsdp=shape is not None and (shape.fsdp or shape.fsdp1) is not None,
                reduced=shape is not None and shape.ddp and self._hook_ctx is None,
                dtensor=shape is not None and shape.dtensor,
            )
        except Exception as exc:
            self._faults.hit("grad_norm", exc)
            read = False
        if read:
            spent = time.perf_counter() - t0
            self._self_time.grad_norm_s += spent
            self._self_time.hooks_s -= spent

    def _boundary(self, skipped: bool = False) -> None:
        st = self.state
        every = self.config.digest_every_steps
        digest = None
        if every and st.step % every == 0 and self._digester is not None:
            t0 = time.perf_counter()
            try:
                digest = Guarded(self._digester.start(), self._faults)
            except Exception as exc:  # the record still goes out, without param_digest
                self._faults.hit("param_digest", exc)
            spent = time.perf_counter() - t0
            self._self_time.digest_s += spent
            self._self_time.hooks_s -= spent
        lr = None
        try:
            if self._optimizer is not None and self._optimizer.param_groups:
                lr = self._optimizer.param_groups[0].get("lr")
        except Exception as exc:
            self._faults.hit("lr", exc)
        self._patches.step_done()
        if self._pending is not None:  # the previous step never got its loss
            self._emit_pending()
        self._pending = pending_record(st, digest=digest, lr=lr, skipped=skipped)
        if self._timing is not None:
            self._pending["device"] = (self._timing, self._timing.step_end())
        self._boundaries += 1
        self._tokens_reported = False
        had_loss = st.loss is not None
        st.reset_for_next_step(time.perf_counter())
        st.phase = "data"
        if had_loss:
            self._emit_pending()

    def _emit_pending(self) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        if self._timing is not None:  # CUDA: the values leave the device without a sync
            try:
                copied, events = offload_record(p), p["device"][1]
                if copied is not None and events is not None:
                    events.extra.append(copied)
            except Exception as exc:
                self._faults.hit("device values (host copy)", exc)
        self._sender.put(lambda: build_step_record(self._base, p))

"""`rankscope collect-gpu`: the per-host GPU sidecar.

When the training code cannot (or should not) host the GPU collector, one
sidecar per host samples every GPU and streams ``gpu`` records to the same
sink as the ranks. ``--rank-map`` says which global rank uses which GPU, so
the engine joins readings onto the right rows; without it the engine maps GPU
``i`` of a host to the host's ``i``-th lowest rank.

A host without a usable NVIDIA driver or GPU is told so in one sentence and
the command exits 1 (a sidecar that can see nothing has nothing to do).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from rankscope.pipeline.cli.argtypes import number
from rankscope.pipeline.cli.errors import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "collect-gpu",
        help="sample this host's GPUs (NVML) and stream gpu records to a sink",
        description="Per-host sidecar: sample every GPU of this host through NVML every "
        "--interval-s seconds (plus at once on a critical XID) and send gpu records to --sink.",
    )
    p.add_argument("--job", required=True, help="job name stamped on every record")
    p.add_argument("--sink", required=True,
                   help="where records go: file://DIR, embedded://NAME or kafka://HOST:PORT/TOPIC")
    p.add_argument("--interval-s", type=_positive, default=None,
                   help="seconds between samples (default 1.0)")
    p.add_argument("--rank-map", type=Path, default=None,
                   help="JSON file: GPU index -> global rank, as {\"0\": 8, ...} or [8, 9, ...], "
                   "optionally keyed by host name {\"node03\": {...}}")
    p.add_argument("--host", default=None, help="host name to report (default: this host's)")
    p.add_argument("--devices", type=_index_list, default=None,
                   help="comma-separated GPU indices to sample (default: all)")
    p.add_argument("--duration-s", type=_positive, default=None,
                   help="stop after this many seconds (default: run until interrupted)")
    p.set_defaults(func=run)


_positive = number(float, above=0)


def _index_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected indices like 0,1,2, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative indices, got {text!r}")
    return out


def load_rank_map(path: Path, host: str) -> dict[int, int]:
    """Read a rank map file; CliError saying what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"cannot read rank map {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"rank map {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if isinstance(data, dict) and data and all(not _is_int(k) for k in data):
        if host not in data:
            raise CliError(f"rank map {path} has no entry for host {host!r} "
                           f"(hosts: {', '.join(sorted(data)[:8])})")
        data = data[host]
    if isinstance(data, list):
        data = dict(enumerate(data))
    if not isinstance(data, dict):
        raise CliError(f"rank map {path} should be an object or a list, got {type(data).__name__}")
    out = {}
    for key, rank in data.items():
        if not _is_int(key) or int(key) < 0:
            raise CliError(f"rank map {path}: GPU index {key!r} is not a non-negative integer")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CliError(f"rank map {path}: rank for GPU {key} should be an int >= 0, "
                           f"got {rank!r}")
        out[int(key)] = rank
    return out


def _is_int(key) -> bool:
    try:
        int(key)
    except (TypeError, ValueError):
        return False
    return not isinstance(key, bool)


def run(args: argparse.Namespace) -> int:
    from rankscope.collectors.gpu.collector import GpuCollector, GpuCollectorConfig

    host = args.host or socket.gethostname()
    rank_map = load_rank_map(args.rank_map, host) if args.rank_map else None
    cfg_kw = {}
    if args.interval_s is not None:
        cfg_kw["interval_s"] = args.interval_s
        cfg_kw["counters_interval_s"] = max(args.interval_s, 5.0)
    try:
        cfg = GpuCollectorConfig(**cfg_kw)
        coll = GpuCollector(args.job, args.sink, host=host, devices=args.devices,
                            rank_map=rank_map, config=cfg)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    coll.start()
    try:
        coll.ready.wait()
        if coll.idle:
            raise CliError(f"collect-gpu: {coll.notice}")
        print(f"collect-gpu: sampling GPU(s) {coll.devices} of host {host} every "
              f"{cfg.interval_s:g}s (driver {coll.driver_version}) -> {args.sink}",
              file=sys.stderr)
        end = None if args.duration_s is None else time.monotonic() + args.duration_s
        while not stop.is_set() and not coll.idle:
            left = 0.5 if end is None else min(0.5, end - time.monotonic())
            if left <= 0:
                break
            stop.wait(left)
    except KeyboardInterrupt:
        pass
    finally:
        coll.close()
        signal.signal(signal.SIGTERM, previous)
    st = coll.stats
    print(f"collect-gpu: {st.samples} samples, {st.records} records, {st.xids} XIDs"
          + (f", lost GPU(s) {st.lost_gpus}" if st.lost_gpus else "")
          + (f"; stopped: {coll.notice}" if coll.notice else ""), file=sys.stderr)
    return 1 if coll.notice else 0

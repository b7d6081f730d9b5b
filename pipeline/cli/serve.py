"""``rankscope serve --bus kafka://... --db PATH``: the online service.

Joins a consumer group on ``<prefix>.telemetry`` and ``<prefix>.gpu``,
assembles steps per job, runs the detectors, writes findings to DuckDB and
publishes them to ``<prefix>.findings``; evict/recover verdicts go, signed,
to ``<prefix>.control`` (the secret from ``--control-secret-file`` or
``$RANKSCOPE_CONTROL_SECRET[_FILE]``). Start more processes with the same
``--group`` to split the jobs. SIGTERM/SIGINT: finish the batch, write,
commit, exit 0. See ``pipeline/serve/loop.py`` for the delivery guarantees.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="consume telemetry from Kafka, detect, store findings, signal evict/recover",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--bus", required=True, help="kafka://host:port[,host:port][?options]")
    p.add_argument("--db", required=True, help="DuckDB file for findings (created if missing)")
    p.add_argument("--group", help="consumer group name (default rankscope-serve)")
    p.add_argument("--partitions", type=int, help="partitions of topics created (default 4)")
    p.add_argument("--control-secret-file", help="file holding the control channel's secret")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="do not announce evict/recover (no secret needed)",
    )
    p.add_argument(
        "--share-db",
        action="store_true",
        help="open the DuckDB file only while writing, so several serve processes share it",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=float,
        metavar="S",
        help="seconds between checkpoints and offset commits (default 5)",
    )
    p.add_argument(
        "--exit-when-idle",
        type=float,
        default=None,
        metavar="S",
        help="flush and exit after S seconds without a message (finite replays)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.set_defaults(func=run)


def run(args) -> int:
    from rankscope.collectors.schema.control import load_secret
    from rankscope.pipeline.cli.errors import CliError
    from rankscope.pipeline.serve.loop import ServeConfig, Service
    from rankscope.pipeline.store import StoreError

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    secret = None
    if not args.no_control:
        try:
            if args.control_secret_file:
                with open(args.control_secret_file, "rb") as fh:
                    secret = load_secret(fh.read().strip())
            else:
                secret = load_secret()
        except (OSError, ValueError) as exc:
            raise CliError(f"control secret: {exc} (or pass --no-control)") from None
    try:
        given = {
            "group": args.group,
            "partitions": args.partitions,
            "checkpoint_interval_s": args.checkpoint_interval,
        }  # unset options keep ServeConfig's defaults (one place for them)
        cfg = ServeConfig(
            bus=args.bus,
            db_path=args.db,
            control_secret=secret,
            share_db=args.share_db,
            idle_exit_s=args.exit_when_idle,
            **{k: v for k, v in given.items() if v is not None},
        )
        service = Service(cfg)
    except (ValueError, StoreError) as exc:
        raise CliError(str(exc)) from None
    service.install_signal_handlers()
    try:
        stats = service.run()
    except Exception as exc:
        if type(exc).__module__.startswith("kafka"):
            raise CliError(f"Kafka at {service.bus.url.redacted()}: {exc}") from None
        raise
    print(f"rankscope serve: {stats.summary()}", file=sys.stderr)
    return 0

"""``rankscope serve --bus kafka://... --db PATH``: the online service.

Joins a consumer group on ``<prefix>.telemetry`` and ``<prefix>.gpu``,
assembles steps per job, runs the detectors, writes findings to DuckDB and
publishes them to ``<prefix>.findings``; evict/recover verdicts go, signed,
to ``<prefix>.control`` (the secret from ``--control-secret-file`` or
``$RANKSCOPE_CONTROL_SECRET[_FILE]``). Start more processes with the same
``--group`` to split the jobs. SIGTERM/SIGINT: finish the batch, write,
commit, exit 0. See ``pipeline/serve/loop.py`` for the delivery guarantees.

It logs a start line, the partitions it owns, each new finding and action
sent, and a progress line every 30 s (``--log-format json``: one object a
line); ``--metrics-port`` serves Prometheus metrics; ``--alert-webhook``
posts each evict/recover finding (docs/kafka.md: Logs, Metrics, Alerts).
"""

from __future__ import annotations

import functools

from rankscope.pipeline.cli.verdict_flags import add_verdict_flags, verdict_configs

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
    _add_ops(p)
    add_verdict_flags(p)
    p.set_defaults(func=run)


def _add_ops(p) -> None:
    """Logs, metrics and alerts (what an operator watches)."""
    p.add_argument("--decode-workers", type=int, metavar="N",
                   help="processes decoding large telemetry batches beside the loop, started on "
                        "the first one (default 1; 0: the loop decodes everything)")  # fmt: skip
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text for people, json: one object a line for log shippers")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="debug lines of rankscope; -vv also the Kafka client's INFO")
    p.add_argument("--progress-interval", type=float, metavar="S",
                   help="seconds between progress lines (default 30; 0: none)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address the metrics endpoint binds (default 127.0.0.1)")
    p.add_argument("--alert-webhook", action="append", metavar="URL", default=[],
                   help="POST each evict/recover finding here (repeatable; @FILE: one URL "
                        "a line, for URLs that hold a token)")
    p.add_argument("--alert-format", choices=("json", "slack"), default="json",
                   help="alert body: the finding's fields (json) or {\"text\": ...} (slack)")
    p.add_argument("--alert-secret-file", metavar="F",
                   help="sign alert bodies with this secret (X-Rankscope-Signature)")
    p.add_argument("--alert-timeout", type=float, metavar="S",
                   help="seconds one alert try waits for an answer (default 5)")  # fmt: skip


def _alerts(args):
    from rankscope.pipeline.serve.alerts import AlertConfig

    urls = []
    for given in args.alert_webhook:
        if given.startswith("@"):
            with open(given[1:]) as fh:
                urls += [line.strip() for line in fh if line.strip()]
        else:
            urls.append(given)
    if not urls:
        if args.alert_secret_file or args.alert_timeout is not None:
            raise ValueError("--alert-secret-file and --alert-timeout need --alert-webhook")
        return None
    secret = None
    if args.alert_secret_file:
        with open(args.alert_secret_file, "rb") as fh:
            secret = fh.read().strip()
    extra = {} if args.alert_timeout is None else {"timeout_s": args.alert_timeout}
    return AlertConfig(urls=tuple(urls), body=args.alert_format, secret=secret, **extra)


def run(args) -> int:
    from rankscope.collectors.schema.control import load_secret
    from rankscope.pipeline.cli.errors import CliError
    from rankscope.pipeline.serve.logs import configure_logging
    from rankscope.pipeline.serve.loop import ServeConfig, Service, default_engine_factory
    from rankscope.pipeline.serve.observe import log_summary
    from rankscope.pipeline.store import StoreError

    configure_logging(args.log_format, args.verbose)
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
            "metrics_host": args.metrics_host,
            "decode_workers": args.decode_workers,
        }  # unset options keep ServeConfig's defaults (one place for them)
        if args.progress_interval is not None:  # 0 turns the lines off
            given["progress_interval_s"] = args.progress_interval or None
        cfg = ServeConfig(
            bus=args.bus,
            db_path=args.db,
            control_secret=secret,
            share_db=args.share_db,
            idle_exit_s=args.exit_when_idle,
            metrics_port=args.metrics_port,
            alerts=_alerts(args),
            **{k: v for k, v in given.items() if v is not None},
        )
        engines = functools.partial(default_engine_factory, verdict_configs(args))
        service = Service(cfg, engine_factory=engines)
    except OSError as exc:
        raise CliError(f"serve: {exc}") from None
    except (ValueError, StoreError) as exc:
        raise CliError(str(exc)) from None
    service.install_signal_handlers()
    try:
        stats = service.run()
    except Exception as exc:
        if type(exc).__module__.startswith("kafka"):
            raise CliError(f"Kafka at {service.bus.url.redacted()}: {exc}") from None
        if isinstance(exc, ValueError) and str(exc).startswith("metrics endpoint"):
            raise CliError(str(exc)) from None
        raise
    log_summary(stats)
    return 0

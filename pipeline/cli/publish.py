"""``rankscope publish TRACE --bus kafka://...``: replay a recorded trace into Kafka.

Feeds history into a live ``rankscope serve`` and is the load generator of
the Kafka benchmark. Records go to ``<prefix>.telemetry`` (``gpu`` samples to
``<prefix>.gpu``) keyed by job. Up to ``--batch`` consecutive records of one
job and topic share one message (a JSON array; see ``rankscope.pipeline.bus.kafka``):
per-message overhead, not JSON, is what limits a Python consumer, so batching
is what lets ``serve`` keep up with 100,000 records a second. ``--batch 1``
sends the plain one-record-per-message form.

Records go in time order (a k-way merge by ``t`` over the trace's files,
holding one record per file: a trace of one file per rank reaches ``serve``
as the ranks produced it); ``--file-order`` sends each file whole, one after
the other (a test of ``serve``'s tolerance for disorder). Default is as fast
as possible; ``--rate F`` paces the records by their ``t``, F times faster
than the original run (``--rate`` alone: real time).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

__all__ = ["register", "run", "publish_records", "PublishStats"]


@dataclass(slots=True)
class PublishStats:
    records: int = 0
    messages: int = 0
    seconds: float = 0.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "publish",
        help="send a recorded trace's records to Kafka (replay into a live service)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("trace", nargs="+", help="trace directory or record file(s)")
    p.add_argument("--bus", required=True, help="kafka://host:port[,host:port][?options]")
    p.add_argument(
        "--rate",
        type=float,
        nargs="?",
        const=1.0,
        default=None,
        metavar="FACTOR",
        help="pace by record time, FACTOR times faster than the original run (default 1)",
    )
    p.add_argument(
        "--file-order",
        action="store_true",
        help="send each file whole, one after the other (default: merged by record time)",
    )
    p.add_argument("--batch", type=int, default=512, help="records per message (default 512)")
    p.add_argument(
        "--partitions", type=int, default=4, help="partitions of topics created (default 4)"
    )
    p.set_defaults(func=run)


def _batches(records, batch: int, *, consecutive: bool):
    """Records of one (topic kind, job), at most ``batch`` together, in their order.

    ``consecutive``: only runs of neighbours share a message (pacing by time needs
    that); else each key fills its own message, so a time-ordered stream, which
    interleaves kinds and jobs record by record, still goes in full messages (the
    order within a topic and job, all a consumer can rely on, is kept)."""
    from rankscope.collectors.schema.kafka import topic_for_record

    if consecutive:
        key, buf = None, []
        for rec in records:
            k = (topic_for_record(rec), rec["job"])
            if buf and (k != key or len(buf) >= batch):
                yield key, buf
                buf = []
            key = k
            buf.append(rec)
        if buf:
            yield key, buf
        return
    bufs: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        k = (topic_for_record(rec), rec["job"])
        buf = bufs.setdefault(k, [])
        buf.append(rec)
        if len(buf) >= batch:
            yield k, bufs.pop(k)
    yield from bufs.items()


def publish_records(bus, records, *, batch: int = 512, rate: float | None = None) -> PublishStats:
    """Send ``records`` (validated dicts) through ``bus``; blocks until delivered."""
    from rankscope.pipeline.bus.kafka import encode_records

    stats = PublishStats()
    producer = bus.producer()
    t_start = time.monotonic()
    first_t = None
    try:
        for (kind, job), recs in _batches(records, batch, consecutive=rate is not None):
            if rate is not None:
                rt = recs[-1].get("t")
                if rt is not None:
                    first_t = rt if first_t is None else first_t
                    due = t_start + (rt - first_t) / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
            producer.send(bus.topic(kind), key=job.encode(), value=encode_records(recs))
            stats.records += len(recs)
            stats.messages += 1
        producer.flush()
    finally:
        producer.close()
    stats.seconds = time.monotonic() - t_start
    return stats


def run(args) -> int:
    from rankscope.pipeline.bus.kafka import KafkaBus
    from rankscope.pipeline.cli.errors import CliError
    from rankscope.pipeline.traces.files import ReadReport, iter_records
    from rankscope.pipeline.traces.merge import iter_records_by_time

    if args.batch < 1:
        raise CliError(f"--batch must be >= 1, got {args.batch}")
    if args.rate is not None and args.rate <= 0:
        raise CliError(f"--rate must be > 0, got {args.rate}")
    try:
        bus = KafkaBus(args.bus)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    report = ReadReport()
    try:
        bus.ensure_topics(args.partitions, kinds=("telemetry", "gpu"))
        read = iter_records if args.file_order else iter_records_by_time
        stats = publish_records(bus, read(args.trace, report), batch=args.batch, rate=args.rate)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:
        if type(exc).__module__.startswith("kafka"):
            raise CliError(f"Kafka at {bus.url.redacted()}: {exc}") from None
        raise
    for err in report.errors[:20]:
        print(f"rankscope publish: skipped {err}", file=sys.stderr)
    rate = stats.records / stats.seconds if stats.seconds > 0 else 0.0
    print(
        f"published {stats.records} records in {stats.messages} messages to "
        f"{bus.topic('telemetry')} in {stats.seconds:.2f} s ({rate:,.0f} records/s); "
        f"{report.bad} malformed skipped"
    )
    return 0

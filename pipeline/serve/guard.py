"""Poison containment for ``serve``: a message that cannot be processed costs only itself.

A record that made the engine raise used to stop the service, and since the
offset was not committed the restart read it again and died again (a crash
loop). Now every failure is caught at the message it came from:

- decode: any exception is the message's dead letter (``loop._consume``);
- the engine: a batch that raises is fed again one message at a time (the one
  bounded retry), and the messages that still raise are dead-lettered with
  the reason; the offset moves past them like past any other message;
- building steps on a tick: the failing step is dropped (the assembler pops a
  step before building it), counted and logged, and the loop goes on;
- records on the wrong topic: a ``gpu`` sample on the telemetry topic is taken
  (the engine joins GPU samples whatever their topic); a ``step``, ``beat`` or
  ``check`` record on the gpu topic is dead-lettered (its offsets would not be
  tracked there, so a restart could lose it).
"""

from __future__ import annotations

import json
import logging
from operator import itemgetter

import orjson
from rankscope.pipeline.bus.decode import decode_records

__all__ = ["misrouted", "feed_apart", "tick_guarded", "dump_state", "engine_state",
           "engine_output"]

log = logging.getLogger("rankscope.serve")


def misrouted(good: list[dict], start: int) -> list[tuple[int, str, dict]]:
    """Take the records that do not belong on the gpu topic out of ``good[start:]``;
    returns them as ``(index, reason, record)``, index within the message's good records."""
    mine = good[start:]
    if set(map(itemgetter("type"), mine)) <= {"gpu"}:
        return []
    out, keep = [], []
    for i, rec in enumerate(mine):
        if rec["type"] == "gpu":
            keep.append(rec)
        else:
            out.append((i, f"a {rec['type']} record on the gpu topic (it belongs on telemetry)",
                        rec))  # fmt: skip
    good[start:] = keep
    return out


def feed_apart(part, msgs, now: float, *, gpu_topic: bool, dead) -> tuple[list, int]:
    """After a batch of ``msgs`` made the engine raise: feed each message alone.

    Returns ``(findings, records fed)``; ``dead(msg, reason)`` gets each message that
    raises again. Records already refused at decode were dead-lettered the first
    time and are not again.
    """
    found, fed = [], 0
    for m in msgs:
        good: list[dict] = []
        try:
            decode_records(m.value, good, [])
            if gpu_topic:
                misrouted(good, 0)
            if not good:
                continue
            found.extend(part.engine.feed(good, now))
            fed += len(good)
        except Exception as exc:  # the message is the poison: dead letter, move on
            log.exception("engine failed on one message at offset %s", m.offset)
            dead(m, f"engine error: {type(exc).__name__}: {exc}")
    return found, fed


def tick_guarded(part, now: float, stats) -> list:
    """``part.engine.tick(now)``; a failure drops the step being built, never the service."""
    try:
        return part.engine.tick(now)
    except Exception:
        stats.engine_errors += 1
        if stats.engine_errors <= 10:
            log.exception("engine failed building a step (dropped; the service goes on)")
        return []


def engine_state(part, stats) -> str | None:
    """The partition's engine state as checkpoint JSON; None (logged, counted) when it
    cannot be had: that partition is then neither checkpointed nor committed this time."""
    try:
        return dump_state(part.engine.state_dict())
    except Exception:
        stats.engine_errors += 1
        log.exception("engine state could not be saved; the checkpoint waits")
        return None


def engine_output(part, stats) -> tuple[list, list]:
    """``(score rows, job summaries)`` of the partition's engine for the store; ([], [])
    (logged, counted) when the engine fails to give them."""
    try:
        eng = part.engine
        return eng.drain_scores(), [eng.job_summary(j) for j in eng.jobs]
    except Exception:
        stats.engine_errors += 1
        log.exception("engine scores or job summaries could not be had")
        return [], []


def dump_state(state: dict) -> str:
    """An engine state as checkpoint JSON. orjson first; a value it cannot write (an int
    past 64 bits once stopped every checkpoint, and so every restart) falls back to the
    standard library, which writes any int and NaN (``parse_json`` reads both back)."""
    try:
        return orjson.dumps(state, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
                            ).decode()  # fmt: skip
    except TypeError as exc:
        log.warning("checkpoint state needs the slow JSON writer: %s", exc)
        return json.dumps(state, default=_plain)


def _plain(obj):
    tolist = getattr(obj, "tolist", None)  # numpy arrays and scalars
    return tolist() if tolist is not None else str(obj)

"""Where ``rankscope serve`` hooks into its libraries: kafka-python's rebalance
listener and commit callback, and the garbage collector's settings for the loop.
Kept apart from the loop (``rankscope.pipeline.serve.loop``) because each follows its library's
contract rather than the service's logic.
"""

from __future__ import annotations

import contextlib
import gc
import logging

__all__ = ["log_failed_commit", "loop_gc", "rebalance_listener"]

log = logging.getLogger("rankscope.serve")


@contextlib.contextmanager
def loop_gc():
    """The garbage collector tuned for the loop, restored afterwards.

    A message is ~1,000 record dicts that die together once their columns are
    built; with the default gen-0 threshold (700 new containers) the collector
    runs mid-message, finds them alive and promotes them, and the older
    generations then rescan them (and everything start-up made) over and over:
    about 7% of the loop at 100,000 records/s. Start-up objects are frozen (they
    live as long as the loop) and collections wait for 50,000 new containers."""
    gc.collect()
    gc.freeze()
    old = gc.get_threshold()
    gc.set_threshold(50_000, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def log_failed_commit(offsets, result) -> None:
    if isinstance(result, Exception):
        log.warning("offset commit deferred to the next checkpoint: %s", result)


def rebalance_listener(service):
    """A listener that seeks assigned partitions to their checkpoints.

    kafka-python 3 calls it on its IO thread (an async listener keeps its loop
    going); kafka-python 2 calls a plain listener from ``poll``."""
    try:
        from kafka import AsyncConsumerRebalanceListener
    except ImportError:
        from kafka import ConsumerRebalanceListener

        class _Sync(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                service._revoke(revoked)

            def on_partitions_assigned(self, assigned):
                service._assign(assigned)

        return _Sync()

    class _Async(AsyncConsumerRebalanceListener):
        async def on_partitions_revoked(self, revoked):
            service._revoke(revoked)

        async def on_partitions_assigned(self, assigned):
            service._assign(assigned)

    return _Async()

"""Small training loops in the styles people train with, for the multi-process tests.

Each style module has ``build(rank, world, opts) -> Built`` (model wrapped the
way that style wraps it, optimizer, mesh) and ``train(built, rc, opts)`` (the
loop body, with nothing of rankscope in it but the attach the test made and
``rc.loss``). Faults are registered by the test from outside the loop
(``faults.py``: module and optimizer hooks), before the collector attaches.
"""

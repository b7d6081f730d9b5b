"""Fault kinds the simulation harness injects into real training.

One file per family (``slowdown``, ``corruption``, ``stop``); each kind is a
``Fault`` subclass registered with ``@register_fault``. Every module in this
package is imported on first lookup, so a new kind is one new file.
"""

from rankscope.pipeline.simulate.faults.base import (
    Fault,
    FaultContext,
    fault_class,
    fault_kinds,
    flip_bit,
    parse_bit,
    register_fault,
)

__all__ = [
    "Fault",
    "FaultContext",
    "fault_class",
    "fault_kinds",
    "flip_bit",
    "parse_bit",
    "register_fault",
]

"""Fault-injection harness: real multi-process gloo training with injected faults.

``run_simulation(SimConfig(...), on_record=None)`` runs the ranks, records the
trace with the rank collectors and writes ``labels.jsonl`` and ``meta.json``;
``rankscope simulate`` is its command line. See docs/simulate.md.
"""

from rankscope.pipeline.simulate.config import SimConfig
from rankscope.pipeline.simulate.harness import SimulationResult, run_simulation
from rankscope.pipeline.simulate.model import ModelConfig
from rankscope.pipeline.simulate.spec import (
    FaultSpec,
    SpecError,
    host_of,
    parse_fault,
    parse_topology,
    rank_coords,
)

__all__ = [
    "FaultSpec",
    "ModelConfig",
    "SimConfig",
    "SimulationResult",
    "SpecError",
    "host_of",
    "parse_fault",
    "parse_topology",
    "rank_coords",
    "run_simulation",
]

"""The fake pynvml for tests: the simulator's scripted NVML, injected at the module boundary.

``FakeNvml`` (``rankscope.pipeline.simulate.scripted_nvml.ScriptedNvml``) has every
pynvml function rankscope calls, under the same names, raising pynvml's own
exception classes; tests script its GPUs (``FakeGpu`` fields), make functions
unsupported, lose a GPU, make the driver vanish or inject XIDs. Pass it as
``nvml=`` to the collector, or ``install`` it where ``import pynvml`` looks.
"""

from __future__ import annotations

import sys

from rankscope.pipeline.simulate.scripted_nvml import ScriptedGpu as FakeGpu
from rankscope.pipeline.simulate.scripted_nvml import ScriptedNvml as FakeNvml

__all__ = ["FakeGpu", "FakeNvml", "install"]


def install(monkeypatch, fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` where ``import pynvml`` finds it, for code that imports NVML itself."""
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake

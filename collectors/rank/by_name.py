"""Collective functions a module imported by name before attach.

``from torch.distributed._functional_collectives import all_to_all_single``
binds the original function into the importing module, so replacing the
attribute on torch's module misses every call made through that name:
torchtitan's MoE token dispatcher does exactly this, and its expert all-to-alls
went unrecorded. At attach the wrapper also replaces the original in each loaded
module that holds it under any name; at close the original comes back where the
wrapper still stands. torch's own modules are left alone (they reach these
functions through the module attributes already wrapped), and so is rankscope.
A module imported after attach keeps the original (its calls are not recorded).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Rebound", "rebind", "restore"]

_SKIP = {"torch", "rankscope"}  # top-level packages left alone

Rebound = list[tuple[Any, str, Callable, Callable]]  # (module, name, original, wrapper)


def rebind(originals: dict[str, Callable], wrappers: dict[str, Callable]) -> Rebound:
    """Put each ``wrappers[k]`` where a loaded module holds ``originals[k]``."""
    by_id = {id(orig): (orig, wrappers[k]) for k, orig in originals.items() if k in wrappers}
    done: Rebound = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.partition(".")[0] in _SKIP:
            continue
        try:
            names = vars(mod)
            hits = [(k, by_id[id(v)]) for k, v in list(names.items()) if id(v) in by_id]
        except Exception:  # an odd module object (lazy proxies): nothing to rebind
            continue
        for attr, (orig, wrapper) in hits:
            if names.get(attr) is orig:
                setattr(mod, attr, wrapper)
                done.append((mod, attr, orig, wrapper))
    return done


def restore(done: Rebound) -> None:
    """Undo ``rebind`` where the wrapper is still what the module holds."""
    for mod, attr, orig, wrapper in done:
        try:
            if getattr(mod, attr, None) is wrapper:
                setattr(mod, attr, orig)
        except Exception:
            continue
    done.clear()

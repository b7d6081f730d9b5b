"""Ground truth of a simulated run: ``labels.jsonl`` lines and ``meta.json``.

A label says what was injected, where and when, in the trace format's terms:
``kind`` is the label kind (``sdc-grad``, ``sdc-param`` and ``sdc-reduce`` are
all ``sdc``), ``ranks``/``hosts`` the origin, ``step``/``until`` the faulty
steps (``until`` null: to the end of the trace, which is also how a diverged
replica, a hang and a crash are labelled). ``note`` keeps the exact spec and
``magnitude`` its size: the slowdown factor, the delay in seconds, or for a
corruption the relative change of the corrupted element as the rank saw it.
"""

from __future__ import annotations

from dataclasses import asdict

from rankscope.pipeline.simulate.config import SimConfig
from rankscope.pipeline.simulate.faults import fault_class
from rankscope.pipeline.simulate.spec import host_of, rank_coords

__all__ = ["build_labels", "build_meta"]


def build_labels(cfg: SimConfig, injections: list[dict]) -> list[dict]:
    """One label per labelled fault, magnitudes from what the ranks reported."""
    out = []
    for spec in cfg.faults:
        cls = fault_class(spec.kind)
        if cls.label_kind is None:
            continue
        fault = cls(spec)
        magnitude = fault.magnitude()
        fired = [i for i in injections if i.get("fault") == spec.text]
        if magnitude is None:
            for info in fired:
                if isinstance(info.get("magnitude"), (int, float)):
                    magnitude = info["magnitude"]
                    break
        until = None if (cls.persistent or cls.ends_run) else spec.until_step
        label = {
            "kind": cls.label_kind,
            "ranks": [spec.rank],
            "hosts": [host_of(spec.rank, cfg.ranks_per_host)],
            "step": spec.from_step,
            "until": until,
            "note": f"{spec.text} (fault kind {spec.kind})",
        }
        if magnitude is not None:
            label["magnitude"] = magnitude
        if not fired and cls.ends_run is None and spec.kind.startswith(("sdc", "nonfinite")):
            label["note"] += "; never fired"
        out.append(label)
    return out


def build_meta(cfg: SimConfig, outcome: dict) -> dict:
    """``meta.json`` body (``write_meta`` adds format and version)."""
    return {
        "job": cfg.job,
        "world": cfg.ranks,
        "ranks_per_host": cfg.ranks_per_host,
        "topology": dict(cfg.topology),
        "steps": cfg.steps,
        "seed": cfg.seed,
        "faults": [spec.text for spec in cfg.faults],
        "hosts": {str(r): host_of(r, cfg.ranks_per_host) for r in range(cfg.ranks)},
        "coords": {str(r): rank_coords(r, cfg.topology) for r in range(cfg.ranks)},
        "generator": "rankscope simulate",
        "model": asdict(cfg.model),
        "sink": cfg.sink or f"file://{cfg.out_dir}",
        **outcome,
    }

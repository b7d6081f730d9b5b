"""False alarms and recall on loops rankscope has never seen (issue #14).

Records clean runs of the loop styles people write (``fa_loops.py``:
nanoGPT-like DDP with accumulation and clipping, the same with train.py's
master-only eval and checkpoints, DDP-tutorial-like, AMP; ``fa_sharded.py``:
torchtitan-like FSDP2 and tensor parallel 2 x FSDP2; ``fa_pipeline.py``: 1F1B
over two stages; ``fa_moe.py``: experts spread over the ranks), 4 real gloo
ranks (``--world``) on whatever host this is (a loaded 2-core one is the
point), with the real collector on a file:// sink, plus runs with each fault kind that can
be localized under the style injected from outside the loop (``fa_faults.py``);
then replays every trace through ``rankscope.pipeline.offline.replay`` and
prints findings per 100 clean runs by action and kind (and per style), and
recall and latency per fault kind and style.

Recording and scoring are separate, so a corpus recorded once is re-scored
in seconds after every detector change::

    flock /tmp/rankscope-cpu.lock python bench/bench_false_alarms.py --record out/fa --clean 10
    python bench/bench_false_alarms.py --record out/fa --faults      # one run per fault, per style
    python bench/bench_false_alarms.py --record out/fa --clean 6 --styles fsdp2,tp
    python bench/bench_false_alarms.py --record out/fa8 --clean 6 --world 8  # 8 ranks
    python bench/bench_false_alarms.py --record out/w2 --clean 10 --world 2 \
        --styles nanogpt,tutorial,amp,varlen  # dp 2 jobs: one pair, data-parallel styles
    python bench/bench_false_alarms.py --score out/fa [-v]

``--record`` appends to the folder (new names and seeds), so a corpus grows
in batches. Without arguments: record a small corpus into a temporary folder
and score it.

A straggler is a sleep of ``factor - 1`` times the rank's clean compute
(``--straggler sleep``, the default, as every corpus before) or held at its
factor over its peers' compute (``--straggler held``, ``fa_held.py``): on a
crowded host a sleep is partly given back, so the scores also list straggler
runs by the slowdown they measured. Where every rank has a core of its own
(``--world 2`` here), the plan adds a noisy neighbour (``fa_neighbour.py``): a
busy process that starts sharing the faulty rank's core, scored as a
straggler; its runs need enough steps for the wait to become the rank's usual
(``--steps 200``)::

    python bench/bench_false_alarms.py --record out/nb --faults --fault-tags neighbour1.5 \
        --world 2 --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fa_loops import LOOPS  # noqa: E402
from fa_record import next_index  # noqa: E402
from fa_score import print_scores, score_corpus  # noqa: E402

STYLES = tuple(LOOPS)
# the data-parallel styles: run on 2 ranks too
DP_ONLY = ("nanogpt", "nanogpt_master", "tutorial", "amp", "varlen", "manual", "megatron")


def fault_plan(steps: int, hold: bool = False, world: int = 4) -> list[tuple[str, dict]]:
    """One of each fault kind, on rank 1..3 in turn (rank 1 in a 2-rank job), from the
    middle of the run; a noisy neighbour only where every rank has a core of its own;
    stragglers held at their factor over their peers (``fa_held.py``) or, with
    ``hold`` False, a fixed sleep that a crowded host partly gives back."""
    at = steps // 2
    held = {"hold": True} if hold else {}
    kinds = [
        {"kind": "straggler", "factor": 1.5, **held},
        {"kind": "straggler", "factor": 1.25, **held},
        {"kind": "sdc-param"},
        {"kind": "nonfinite"},
        {"kind": "network", "delay_s": 0.02},
    ]
    if world <= len(os.sched_getaffinity(0)):  # a core per rank (fa_neighbour.py)
        kinds.append({"kind": "neighbour", "factor": 1.5})
    out = []
    for i, f in enumerate(kinds):
        tag = f["kind"] + str(f.get("factor", f.get("delay_s", "")))
        out.append((tag, {**f, "rank": 1 + i % min(3, world - 1), "from": at, "until": None}))
    return out


def plan(corpus: Path, clean: int, faults: bool, steps: int, styles: tuple[str, ...] = STYLES,
         tags: tuple[str, ...] = (), hold: bool = False, world: int = 4) -> list[dict]:  # fmt: skip
    """Clean runs round-robin over ``styles``, then each style's localizable faults
    (those of ``tags``, e.g. ``straggler1.25``, where given)."""
    idx = next_index(corpus)
    runs = []
    for i in range(clean):
        style = styles[(idx + i) % len(styles)]
        runs.append({"name": f"clean-{style}-{idx + i:04d}", "style": style,
                     "seed": idx + i, "steps": steps, "fault": None})  # fmt: skip
    idx += clean
    if faults:
        for style in styles:
            for tag, f in fault_plan(steps, hold, world):
                host_level = f["kind"] == "neighbour"  # any loop: its host's, not its own
                if (f["kind"] not in LOOPS[style].faults and not host_level) or (
                        tags and tag not in tags):  # fmt: skip
                    continue
                runs.append({"name": f"fault-{tag}-{style}-{idx:04d}", "style": style,
                             "seed": idx, "steps": steps, "fault": f})  # fmt: skip
                idx += 1
    return runs


def record(corpus: Path, runs: list[dict], batch: int, world: int = 4) -> None:
    from fa_record import record_batch

    for i in range(0, len(runs), batch):
        part = runs[i : i + batch]
        t0 = time.perf_counter()
        record_batch(part, corpus, world=world)
        dt = time.perf_counter() - t0
        print(f"recorded {len(part)} runs in {dt:.1f} s ({', '.join(r['name'] for r in part)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", metavar="DIR", help="record runs into DIR (appends)")
    ap.add_argument("--score", metavar="DIR", help="replay and score the runs in DIR")
    ap.add_argument("--clean", type=int, default=0, help="clean runs to record")
    ap.add_argument("--faults", action="store_true", help="record one run per fault and style")
    ap.add_argument("--fault-tags", default="",
                    help="with --faults: only these, comma-separated (e.g. straggler1.25)")
    ap.add_argument("--straggler", choices=("sleep", "held"), default="sleep",
                    help="stragglers: a fixed sleep of factor - 1 times the rank's clean "
                         "compute (default), or held at factor x their peers' compute")  # fmt: skip
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--batch", type=int, default=6, help="runs per process launch")
    ap.add_argument("--world", type=int, default=4,
                    help="ranks per run, all on this host (even: tp and pp split it in two; "
                         "2 for the data-parallel styles only)")  # fmt: skip
    ap.add_argument("--styles", default=",".join(STYLES),
                    help=f"loop styles to record, comma-separated (default {','.join(STYLES)})")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every finding")
    a = ap.parse_args(argv)
    if a.clean < 0 or a.steps < 10 or a.batch < 1:
        ap.error("--clean must be >= 0, --steps >= 10, --batch >= 1")
    styles = tuple(s for s in a.styles.split(",") if s)
    if a.world == 2 and not set(styles) <= set(DP_ONLY):  # a dp 2 job: two peers
        ap.error(f"--world 2 takes only the data-parallel styles ({', '.join(DP_ONLY)})")
    elif a.world < 2 or a.world % 2:
        ap.error("--world must be even and >= 2 (4 or more for tp and pp: they split it in two)")
    unknown = [s for s in styles if s not in LOOPS]
    if unknown or not styles:
        ap.error(f"--styles: unknown {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(STYLES)}")  # fmt: skip
    if a.record and not (a.clean or a.faults):
        ap.error("--record needs --clean N and/or --faults")
    tags = tuple(t for t in a.fault_tags.split(",") if t)
    known_tags = [t for t, _ in fault_plan(a.steps, world=a.world)]
    if [t for t in tags if t not in known_tags]:
        ap.error(f"--fault-tags: known: {', '.join(known_tags)}")
    if not (a.record or a.score):
        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(tmp)
            record(corpus, plan(corpus, len(styles), True, a.steps, styles), a.batch)
            print_scores(score_corpus(corpus), a.verbose)
        return 0
    if a.record:
        corpus = Path(a.record)
        runs = plan(corpus, a.clean, a.faults, a.steps, styles, tags, hold=a.straggler == "held",
                    world=a.world)
        record(corpus, runs, a.batch, a.world)
    if a.score:
        corpus = Path(a.score)
        if not corpus.is_dir():
            ap.error(f"--score: {corpus} is not a folder")
        t0 = time.perf_counter()
        s = score_corpus(corpus)
        print_scores(s, a.verbose)
        print(f"scored in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

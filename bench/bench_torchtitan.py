"""torchtitan's real trainer under the collector: clean runs and injected faults.

The false-alarm bench (``bench_false_alarms.py``) runs loops written in the
styles people use; this one runs a loop rankscope did not write at all:
torchtitan 0.3's ``Trainer`` (``torchtitan.train.main``), unchanged, under
``torchrun`` with 4 gloo ranks on CPU (``titan_cpu.py``: the CPU shims, the
attach, the faults). Styles are torchtitan's own parallelisms:

- ``titan_fsdp``: llama3 debug model, FSDP2 over 4 ranks;
- ``titan_fsdp_tp``: FSDP2 2 x tensor parallel 2 (DTensor, loss parallel);
- ``titan_hsdp``: HSDP, 2 replicas of FSDP2 over 2 ranks (replicate x shard);
- ``titan_pp``: FSDP2 2 x pipeline 2 (Interleaved1F1B, two stages a rank);
- ``titan_moe_ep``: deepseek_v3 debug model (mixture of experts), FSDP2 4 with
  expert parallel 2 (DTensor backend: gloo has no uneven ``all_to_all`` list).

torchtitan comes from the ``.titan`` overlay (``make titan``: pinned wheels in
``--target`` form, outside the virtual environment, whose Hugging Face pins
they would break; ``RANKSCOPE_TITAN_LIB`` overrides the path). Its tokenizer
and dataset are generated here (a small byte-level BPE and synthetic text).
The corpus has the false-alarm bench's layout, so it scores the same way::

    python bench/bench_torchtitan.py --record out/tt --clean 2 --faults 1
    python bench/bench_torchtitan.py --score out/tt [-v]

Without arguments: one clean and one faulty run per fault kind of ``titan_fsdp``
(30 steps) in a temporary folder, scored.

A straggler sleeps ``factor - 1`` times the style's median clean ``compute_s``
(from the corpus's clean runs, recorded first) in each faulty step's first
forward; a NaN poisons the rank's logits at one step (not under tensor
parallelism: loss parallel spreads it to the partner in the same forward, so
the pair is all the telemetry can name). Under expert parallelism the
backward's all-to-all carries it into the partner's experts in the same step;
the loss the collector reads from ``backward`` (torchtitan keeps it inside
``train_step``) says whose forward went first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fa_faults import label  # noqa: E402
from fa_record import next_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOST = "node00"
_COMMON = ["--training.seq_len", "256", "--training.local_batch_size", "2",
           "--checkpoint.no-enable", "--validator.no-enable", "--compile.no-enable",
           "--training.disable_cuda_graphs"]  # fmt: skip
STYLES = {  # name: (module, config, parallelism arguments, faults)
    "titan_fsdp": ("llama3", "llama3_debugmodel",
                   ["--parallelism.data_parallel_shard_degree", "4"], ("straggler", "nonfinite")),
    "titan_fsdp_tp": ("llama3", "llama3_debugmodel",
                      ["--parallelism.data_parallel_shard_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2"], ("straggler",)),
    "titan_hsdp": ("llama3", "llama3_debugmodel",
                   ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2"], ("straggler", "nonfinite")),
    "titan_pp": ("llama3", "llama3_debugmodel",
                 ["--parallelism.data_parallel_shard_degree", "2",
                  "--parallelism.pipeline_parallel_degree", "2"], ("straggler",)),
    "titan_moe_ep": ("deepseek_v3", "deepseek_v3_debugmodel",
                     ["--parallelism.data_parallel_shard_degree", "4",
                      "--parallelism.expert_parallel_degree", "2",
                      "--parallelism.spmd_backend", "full_dtensor"], ("straggler", "nonfinite")),
}  # fmt: skip
WORDS = ("the model reads tokens from many sources while each rank trains on its own shard "
         "of text and gradients cross the mesh of devices at every step of the job").split()


def titan_lib() -> Path | None:
    """The overlay holding torchtitan and its pinned dependencies, if installed."""
    lib = Path(os.environ.get("RANKSCOPE_TITAN_LIB") or ROOT / ".titan")
    return lib if (lib / "torchtitan" / "train.py").is_file() else None


def make_assets(work: Path) -> Path:
    """torchtitan's test assets, made here: ``tests/assets/tokenizer`` (byte-level
    BPE) and ``tests/assets/c4_test/data.json``; returns ``work`` (the run's cwd)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = work / "tests/assets/tokenizer", work / "tests/assets/c4_test"
    if (tok_dir / "tokenizer.json").is_file() and (data_dir / "data.json").is_file():
        return work
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 400))) for _ in range(3000)]
    with open(data_dir / "data.json", "w") as fh:
        for i, text in enumerate(texts):
            fh.write(json.dumps({"text": text, "timestamp": "2019", "url": f"u{i}"}) + "\n")
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:500], trainers.BpeTrainer(
        vocab_size=512, special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return work


def run_titan(style: str, steps: int, work: Path, log: Path, env_extra: dict,
              seed: int = 0, timeout_s: float = 900) -> int:  # fmt: skip
    """One torchtitan run of ``style`` for ``steps`` steps on 4 gloo ranks; its
    output goes to ``log``; returns torchrun's exit status."""
    lib = titan_lib()
    if lib is None:
        raise SystemExit("torchtitan is not installed: `make titan` (or RANKSCOPE_TITAN_LIB)")
    module, config, par, _ = STYLES[style]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib), str(ROOT / "bench")]),
           "OMP_NUM_THREADS": "1", **env_extra}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "bench" / "titan_cpu.py"), "--module", module, "--config", config,
           "--training.steps", str(steps), "--debug.seed", str(seed), *_COMMON, *par]  # fmt: skip
    with open(log, "w") as fh:
        try:
            return subprocess.run(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return 124


def _clean_compute(corpus: Path, style: str) -> float:
    """Median ``compute_s`` (steps 5 on, every rank) over the corpus's clean runs of ``style``."""
    vals = []
    for run in corpus.glob(f"clean-{style}-*"):
        for path in run.glob("rank*.jsonl"):
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r.get("type") == "step" and r["step"] >= 5 and r.get("compute_s"):
                    vals.append(r["compute_s"])
    if not vals:
        raise SystemExit(f"no clean {style} run in {corpus} to size a straggler by")
    return statistics.median(vals)


def record(corpus: Path, style: str, steps: int, fault: dict | None) -> None:
    idx = next_index(corpus)
    name = f"{'clean' if fault is None else 'fault-' + fault['kind']}-{style}-{idx:04d}"
    folder = corpus / name
    (corpus / "_logs").mkdir(parents=True, exist_ok=True)
    env = {"RANKSCOPE_SINK": f"file://{folder}", "RANKSCOPE_JOB": name,
           "RANKSCOPE_FAULT": json.dumps(fault) if fault else ""}  # fmt: skip
    t0 = time.perf_counter()
    work = make_assets(corpus / "_assets")
    rc = run_titan(style, steps, work, corpus / "_logs" / f"{name}.log", env, seed=idx)
    if rc != 0 and not (fault and fault["kind"] == "nonfinite"):  # torchtitan stops on NaN
        raise SystemExit(f"{name}: torchtitan exited {rc}; see {corpus}/_logs/{name}.log")
    with open(folder / "labels.jsonl", "w") as fh:
        for lab in label(fault, HOST):
            fh.write(json.dumps(lab) + "\n")
    meta = {"generator": "bench_torchtitan", "world": 4, "name": name, "style": style,
            "seed": idx, "steps": steps, "fault": fault}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", type=Path, help="append runs to this corpus folder")
    ap.add_argument("--score", type=Path, help="replay and score this corpus folder")
    ap.add_argument("--clean", type=int, default=0, help="clean runs per style")
    ap.add_argument("--faults", type=int, default=0, help="runs per fault kind and style")
    ap.add_argument("--styles", default=",".join(STYLES), help="comma-separated styles")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-from", type=int, default=20, help="the faulty step")
    ap.add_argument("--factor", type=float, default=1.5, help="a straggler's slowdown")
    ap.add_argument("-v", action="store_true", help="list every finding and miss")
    args = ap.parse_args()
    styles = [s for s in args.styles.split(",") if s]
    unknown = [s for s in styles if s not in STYLES]
    if unknown:
        ap.error(f"unknown style(s) {unknown} (known: {', '.join(STYLES)})")
    if not (args.record or args.score):  # `make bench`: a small corpus, scored
        tmp = tempfile.TemporaryDirectory()
        args.record = args.score = Path(tmp.name)
        args.clean, args.faults, args.steps, styles = 1, 1, 30, ["titan_fsdp"]
    if args.record:
        for style in styles:
            for _ in range(args.clean):
                record(args.record, style, args.steps, None)
        for style in styles:
            for kind in STYLES[style][3] if args.faults else ():
                for n in range(args.faults):
                    fault = {"kind": kind, "rank": 1 + n % 3, "from": args.fault_from}
                    if kind == "straggler":
                        fault["factor"] = args.factor
                        base = _clean_compute(args.record, style)
                        fault["sleep_s"] = round((args.factor - 1.0) * base, 4)
                    record(args.record, style, args.steps, fault)
    if args.score:
        from fa_score import print_scores, score_corpus

        print_scores(score_corpus(args.score), verbose=args.v)


if __name__ == "__main__":
    main()

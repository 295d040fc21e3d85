"""What holding the prompt once per group saves in GRPO's update: time and memory per rank.

    python benchmarks/grpo_sharing.py                        # about 10 minutes on 2 cores
    python benchmarks/grpo_sharing.py --prompt-tokens 16000 --runs 3

The same `rl: grpo` run (LoRA, `num_generations` 4, the KL to the base with the adapter off)
through `longctx train` at sp 2 (the default ring), once with `prefix_sharing: false` (each
completion after its own copy of the prompt, as TRL and the other trainers lay them out) and
once with the prompt shared (the default: the prompt once, every further completion a branch
after it): a Llama from config (hidden 256, 4 layers, 8 heads, the byte vocabulary), float32,
one prompt of `--prompt-tokens` bytes a step, 16-token completions. Rollouts are the same in
both (sampling always prefills a prompt once for its group, seeded alike), so the runs train
the same completions to the same losses (checked at every step). The runs alternate; a run's
update time is the median of its steps' `update_s`, the table shows the min / median / max
of those over runs, with each rank process's peak resident set (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import yaml
from common import ROOT, alternating_runs, metrics_records, same_losses, save_record

from benchmarks.peers import run_watched
from benchmarks.prefix_sharing import MODEL, WORDS, save_model

# The byte tokenizer decodes the sampled completions for the reward: a vocabulary it covers.
MODEL = {**MODEL, "vocab_size": 384}

REWARD = '''
def vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]
'''


def write_prompts(path: Path, count: int, prompt_tokens: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(prompt_tokens // 5))
            f.write(json.dumps({"prompt": f"Document {i}: {text}"[:prompt_tokens]
                                + "\nWhich word came first?"}) + "\n")


def config(work: Path, shared: bool, sequence_len: int, steps: int) -> Path:
    name = "shared" if shared else "unshared"
    settings = {
        "base_model": str(work / "model"), "tokenizer": "byte", "dtype": "float32",
        "datasets": [{"path": str(work / "prompts.jsonl"), "type": "prompt"}],
        "dataset_prepared_path": str(work / "prepared"), "rl": "grpo",
        "trl": {"reward_funcs": ["reward.vowels"], "num_generations": 4,
                "max_completion_length": 16, "beta": 0.04},
        "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "prefix_sharing": shared, "sequence_len": sequence_len,
        "sequence_parallel_degree": 2, "world_size": 2, "micro_batch_size": 4,
        "gradient_accumulation_steps": 1, "max_steps": steps, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "seed": 0, "save_strategy": "no", "logging_steps": 1,
        "output_dir": str(work / f"out-{name}"),
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def one_run(path: Path, log: Path) -> dict:
    _, peaks = run_watched([sys.executable, "-m", "longctx_cli", "train", str(path),
                            "--overwrite"], log)
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    steps = [r for r in metrics_records(out) if "update_s" in r]
    return {"update_s": [r["update_s"] for r in steps],
            "rollout_s": [r["rollout_s"] for r in steps],
            "losses": [r["loss"] for r in steps], "rewards": [r.get("reward") for r in steps],
            "peak_mib": sorted(k / 1024 for k in peaks.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "grpo_sharing")
    args = p.parse_args()

    work = args.work
    save_model(work, MODEL)
    (work / "reward.py").write_text(REWARD)
    write_prompts(work / "prompts.jsonl", args.steps, args.prompt_tokens)
    sequence_len = args.prompt_tokens + 256  # prompt + completion
    configs = {shared: config(work, shared, sequence_len, args.steps) for shared in (False, True)}
    runs = alternating_runs(configs, args.runs, work, one_run, lambda result: (
        f"update s {[round(s, 2) for s in result['update_s']]}, rollout s "
        f"{[round(s, 2) for s in result['rollout_s']]}, peak "
        f"{[round(m) for m in result['peak_mib']]} MiB"))
    same_losses(runs[False][0]["losses"], runs[True][0]["losses"], 1e-4, floor=1e-3)
    rows = {}
    for shared, results in runs.items():
        updates = [statistics.median(r["update_s"]) for r in results]
        rollouts = [statistics.median(r["rollout_s"]) for r in results]
        peaks = [m for r in results for m in r["peak_mib"]]
        rows["shared" if shared else "unshared"] = {
            "update_s": [min(updates), statistics.median(updates), max(updates)],
            "rollout_s": [min(rollouts), statistics.median(rollouts), max(rollouts)],
            "peak_mib": [min(peaks), max(peaks)], "losses": results[0]["losses"]}
    print(f"\nGRPO + LoRA, sp 2 (the default ring), one prompt of {args.prompt_tokens} tokens and "
          "4 completions a step")
    print(f"{'':10} {'update s min / median / max':>30} {'rollout s median':>17} "
          f"{'peak RSS per rank (MiB)':>26}")
    for name, row in rows.items():
        u, r, m = row["update_s"], row["rollout_s"], row["peak_mib"]
        print(f"{name:10} {u[0]:>12.2f} / {u[1]:.2f} / {u[2]:.2f} {r[1]:>17.2f} "
              f"{m[0]:>14,.0f} - {m[1]:,.0f}")
    saving = 1 - rows["shared"]["update_s"][1] / rows["unshared"]["update_s"][1]
    print(f"update time saved (medians): {saving:.0%}; losses equal at every step")
    save_record("grpo-sharing", {
        "command": " ".join(["benchmarks/grpo_sharing.py", *sys.argv[1:]]),
        "prompt_tokens": args.prompt_tokens, "sequence_len": sequence_len, "model": MODEL,
        "runs": args.runs, "steps": args.steps, "rows": rows, "raw": {
            "shared" if k else "unshared": v for k, v in runs.items()}})


if __name__ == "__main__":
    main()

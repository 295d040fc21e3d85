"""What `prefix_sharing` saves on long-prompt preference pairs: time per step and memory.

    python benchmarks/prefix_sharing.py                      # about 10 minutes on 2 cores
    python benchmarks/prefix_sharing.py --prompt-tokens 12000 --runs 3

The same DPO run (LoRA, the reference being the base with the adapter off) through `longctx
train` at sp 2 (the default ring: on CPU the P2P stripe ring), once with every pair's prompt
in both of its sequences and once with `prefix_sharing: true` (the prompt once, the rejected
answer a branch after it): a Llama from config (hidden 256, 4 layers, 8 heads, vocabulary
32,000), float32, one pair a step, pairs whose prompt is `--prompt-tokens` bytes and whose
answers are about 60. The runs alternate; a run's time per step is the median of its steps
after the first, and the table shows the min / median / max of those over runs, with each
rank process's peak resident set (VmHWM). Both must train the same pairs to the same losses
(checked at every step), which is what makes the saving a saving.
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

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "vocab_size": 32000, "max_position_embeddings": 65536}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda sigma".split()


def write_pairs(path: Path, pairs: int, prompt_tokens: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(pairs):
            text = " ".join(rng.choice(WORDS) for _ in range(prompt_tokens // 5))
            prompt = f"Document {i}: {text}"[:prompt_tokens] + "\nWhich word came first?"
            first = text.split()[0]
            f.write(json.dumps({"prompt": prompt, "chosen": f" The first word was {first}.",
                                "rejected": " I could not tell which word came first."})
                    + "\n")


def save_model(work: Path, fields: dict) -> None:
    """The benchmark's model (random, seed 0) in `work/model`, unless it is there already."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).save_pretrained(
            work / "model")


def config(work: Path, shared: bool, sequence_len: int, steps: int) -> Path:
    name = "shared" if shared else "unshared"
    settings = {
        "base_model": str(work / "model"), "tokenizer": "byte", "dtype": "float32",
        "datasets": [{"path": str(work / "pairs.jsonl"), "type": "preference"}],
        "dataset_prepared_path": str(work / "prepared"), "rl": "dpo", "rl_beta": 0.1,
        "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "prefix_sharing": shared, "sequence_len": sequence_len, "sample_packing": False,
        "sequence_parallel_degree": 2, "world_size": 2, "micro_batch_size": 1,
        "gradient_accumulation_steps": 1, "max_steps": steps, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "val_set_size": 0, "seed": 0, "save_strategy": "no",
        "logging_steps": 1, "output_dir": str(work / f"out-{name}"),
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def one_run(path: Path, log: Path) -> dict:
    _, peaks = run_watched([sys.executable, "-m", "longctx_cli", "train", str(path),
                            "--overwrite"], log)
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    steps = [r for r in metrics_records(out) if "tokens_per_sec" in r]
    return {"seconds": [r["tokens"] / r["tokens_per_sec"] for r in steps],
            "losses": [r["loss"] for r in steps],
            "peak_mib": sorted(k / 1024 for k in peaks.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "prefix_sharing")
    args = p.parse_args()

    work = args.work
    save_model(work, MODEL)
    write_pairs(work / "pairs.jsonl", args.steps, args.prompt_tokens)
    # Room for both sequences of the longest pair, unshared; a multiple of 4 (zigzag, sp 2).
    sequence_len = -(-(2 * (args.prompt_tokens + 120)) // 4) * 4
    configs = {shared: config(work, shared, sequence_len, args.steps) for shared in (False, True)}
    runs = alternating_runs(configs, args.runs, work, one_run, lambda result: (
        f"s/step {[round(s, 2) for s in result['seconds']]}, "
        f"peak {[round(m) for m in result['peak_mib']]} MiB"))
    same_losses(runs[False][0]["losses"], runs[True][0]["losses"], 1e-4)
    rows = {}
    for shared, results in runs.items():
        medians = [statistics.median(r["seconds"][1:]) for r in results]
        peaks = [m for r in results for m in r["peak_mib"]]
        rows["shared" if shared else "unshared"] = {
            "s_per_step": [min(medians), statistics.median(medians), max(medians)],
            "peak_mib": [min(peaks), max(peaks)], "losses": results[0]["losses"]}
    print(f"\nDPO + LoRA, sp 2 (the default ring), one pair a step, prompt {args.prompt_tokens} "
          "tokens")
    print(f"{'':10} {'s/step min / median / max':>28} {'peak RSS per rank (MiB)':>26}")
    for name, row in rows.items():
        s, m = row["s_per_step"], row["peak_mib"]
        print(f"{name:10} {s[0]:>10.2f} / {s[1]:.2f} / {s[2]:.2f} {m[0]:>14,.0f} - {m[1]:,.0f}")
    saving = 1 - rows["shared"]["s_per_step"][1] / rows["unshared"]["s_per_step"][1]
    print(f"time per step saved (medians): {saving:.0%}; losses equal at every step")
    save_record("prefix-sharing", {
        "command": " ".join(["benchmarks/prefix_sharing.py", *sys.argv[1:]]),
        "prompt_tokens": args.prompt_tokens, "sequence_len": sequence_len, "model": MODEL,
        "runs": args.runs, "steps": args.steps, "rows": rows, "raw": {
            "shared" if k else "unshared": v for k, v in runs.items()}})


if __name__ == "__main__":
    main()

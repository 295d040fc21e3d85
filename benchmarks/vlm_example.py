"""What the vision-language example learns (`examples/tiny_vlm.yaml`), over seeds.

    python benchmarks/vlm_example.py [--seeds 1 2 3]

For each seed: `longctx train` the example (sp=2 on this machine's CPU), then ask the
held-out records' question of the initial model and of the trained one, both loaded in
transformers as the model's own class (`AutoModelForImageTextToText`) with the saved
processor. A record is right when the model's most likely next token is the label of the
red image. Chance is one in sixteen. Prints a table and writes
`benchmarks/results/vlm-example-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, cpu_model, markdown_table, metrics_records, shown, write_results

CONFIG = ROOT / "examples" / "tiny_vlm.yaml"
DATA = ROOT / "examples" / "data" / "vlm"


def accuracy(model, processor, records: list[dict]) -> float:
    """Share of `records` whose answer is the model's most likely next token."""
    import torch
    from PIL import Image

    right = 0
    for record in records:
        question = record["messages"][:1]
        text = processor.apply_chat_template(question, tokenize=False,
                                             add_generation_prompt=True)
        images = [Image.open(DATA / part["path"]).convert("RGB")
                  for part in question[0]["content"] if part["type"] == "image"]
        inputs = processor(text=[text], images=images, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1]
        answer = processor.tokenizer.decode([int(logits.argmax())])
        right += answer == record["messages"][1]["content"]
    return right / len(records)


def initial_model(seed: int):
    """The example's model before training: longctx's own random init for `seed`."""
    from longctx_cli.config import load_config
    from longctx_cli.runtime.model import load_base_model

    config = load_config(CONFIG, ["--seed", str(seed)])
    return load_base_model(config, "eager").eval()


def trained_model(folder: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()


def run_seed(seed: int, out: Path) -> dict:
    from longctx_cli.data.vision import load_processor

    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longctx_cli", "train", str(CONFIG),
                    "--nproc-per-node", "2", "--seed", str(seed), "--output-dir", str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    train_s = time.perf_counter() - started
    records = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()]
    processor = load_processor(str(out / "final")).processor
    before = accuracy(initial_model(seed), processor, records)
    trained = trained_model(out / "final")
    after = accuracy(trained, processor, records)
    metrics = metrics_records(out)
    losses = [m["loss"] for m in metrics if "loss" in m and "step" in m]
    return {"seed": seed, "before": before, "after": after, "train_seconds": round(train_s, 1),
            "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "model_class": type(trained).__name__, "test_records": len(records)}


def machine_line() -> str:
    """"x86_64, 2 cores, AMD EPYC ...": the machine as this benchmark's results name it."""
    return (f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{cpu_model() or platform.processor() or '?'}")


def table(data: dict) -> str:
    """The runs as a Markdown table (printed, and written into docs/vlm.md by figures.py)."""
    return markdown_table(
        ["seed", "accuracy before", "accuracy after", "training", "loss, first -> last step"],
        ([r["seed"], f"{r['before']:.0%}", f"{r['after']:.0%}",
          f"{r['train_seconds'] / 60:.1f} min", f"{r['first_loss']:.2f} -> {r['last_loss']:.3f}"]
         for r in data["runs"]), right=range(4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "vlm_example")
    args = parser.parse_args()
    if not (DATA / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(ROOT / "examples" / "vlm_images.py"),
                        str(DATA)], check=True)
    runs = [run_seed(seed, args.out / f"seed{seed}") for seed in args.seeds]
    result = {
        "benchmark": "vlm_example", "config": str(CONFIG.relative_to(ROOT)),
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "load_average": os.getloadavg()[0], "chance": 1 / 16, "runs": runs,
    }
    print(table(result))
    path = write_results(RESULTS / f"vlm-example-{result['date']}.json", result)
    print(f"wrote {shown(path)}")


if __name__ == "__main__":
    main()

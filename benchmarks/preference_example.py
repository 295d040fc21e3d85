"""Rerun the preference example (examples/tiny_preference.yaml) for several seeds and report
held-out reward accuracy by step.

    python benchmarks/preference_example.py --seeds 1 2 3

Each run is what a user types: `python examples/preference_pairs.py <data> --seed S`, then
`longctx train <copy of the config> --nproc-per-node 2 --overwrite` with the config's `seed`
(model init and data order) set to S and its data path and output_dir pointed at a scratch
folder. The held-out accuracy is `eval_rewards/accuracies` of metrics.jsonl: the share of
held-out pairs (64 rows, about 130 pairs) whose chosen answer gets the higher reward.
Prints a table and writes benchmarks/results/preference_example-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import RESULTS, ROOT, metrics_records, shown, write_results

EXAMPLE = ROOT / "examples" / "tiny_preference.yaml"
ACCURACY = "eval_rewards/accuracies"


def run(seed: int, work: Path) -> dict:
    data = work / f"pairs-{seed}.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "preference_pairs.py"), str(data),
                    "--seed", str(seed)], check=True, capture_output=True)
    config = yaml.safe_load(EXAMPLE.read_text())
    config["seed"] = seed
    config["datasets"][0]["path"] = str(data)
    config["output_dir"] = str(work / f"out-{seed}")
    config["dataset_prepared_path"] = str(work / f"prepared-{seed}")
    path = work / f"config-{seed}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longctx_cli", "train", str(path), "--nproc-per-node",
                    "2", "--overwrite"], check=True, capture_output=True, cwd=work,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - started
    records = metrics_records(work / f"out-{seed}")
    curve = {r["step"]: r[ACCURACY] for r in records if ACCURACY in r}
    return {"seed": seed, "seconds": round(seconds, 1), "held_out_accuracy": curve,
            "eval_pairs_loss": {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="longctx-pref-") as tmp:
        for seed in args.seeds:
            runs.append(run(seed, Path(tmp)))
            print(f"seed {seed}: {runs[-1]['seconds']} s", flush=True)
    steps = sorted(runs[0]["held_out_accuracy"])
    print("\nheld-out reward accuracy (share of pairs whose chosen answer wins)")
    print("step  " + "  ".join(f"seed {r['seed']:>2}" for r in runs) + "   range")
    for step in steps:
        values = [r["held_out_accuracy"][step] for r in runs]
        print(f"{step:>4}  " + "  ".join(f"{v:>7.1%}" for v in values)
              + f"   {min(values):.1%}-{max(values):.1%}")
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    out = write_results(RESULTS / f"preference_example-{time.strftime('%Y-%m-%d')}.json",
                        {"machine": machine, "config": str(EXAMPLE.relative_to(ROOT)),
                         "runs": runs})
    print(f"\nmachine: {machine}\nwrote {shown(out)}")


if __name__ == "__main__":
    main()

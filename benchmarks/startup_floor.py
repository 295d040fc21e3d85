"""The least time any rank of a training job needs before its first step: its imports.

    python benchmarks/startup_floor.py            # about 1 minute on 2 cores

`longctx train` records its own start-up, phase by phase (output_dir/startup.json;
`benchmarks/peers.py` reports it as "first step after"). This script measures what no
launcher design can remove: the time from a Python process's creation until it has imported
what a rank of the peer benchmark's job runs on,

- `torch`,
- the model's own code (`transformers`, `datasets` for the prepared rows, the model class),
  as transformers loads it where torchao is installed (it imports torchao to offer its
  quantization) and as a longctx rank loads it (torchao hidden: the run uses neither its
  optimizers nor its quantization),
- longctx's training loop (its schedules are built on torch's LambdaLR: no
  `transformers.optimization`, which would import peft and bitsandbytes),

each in a fresh process, one at a time and then as many at once as the job has ranks on a
node (`--ranks`, 2 for the peer benchmark's sp 2), and torchrun's agent (`import
torch.distributed.run`), which starts before the ranks. One compute thread per process, as
in the benchmark. Every figure is the min / median / max over `--runs` runs; the table and
JSON (benchmarks/results/startup-floor-<date>.json) say on which machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

from common import save_record

from benchmarks.peers import one_thread_env

# What each measured process imports, cumulatively (each step includes the ones before).
# A rank hides torchao from transformers first (longctx_cli.launcher.startup.hide_torchao):
# "model code" shows what transformers costs with it, as other tools pay it.
HIDE_TORCHAO = "from longctx_cli.launcher.startup import hide_torchao\nhide_torchao()\n"
MODEL_CODE = ("import torch, transformers, datasets\n"
              "from transformers import LlamaForCausalLM\n")
STAGES = {
    "python": "",
    "torch": "import torch",
    "model code": MODEL_CODE,
    "model code, torchao hidden": HIDE_TORCHAO + MODEL_CODE,
    "+ longctx loop": HIDE_TORCHAO + MODEL_CODE + "import longctx_cli.train.loop",
    "torchrun agent": "import torch.distributed.run",
}
# Printed by each measured process: seconds since its creation (Linux /proc).
PROBE = """
from longctx_cli.launcher.startup import process_created_at
_origin = process_created_at()
{imports}
import time
print(f"SECONDS {{time.time() - _origin:.4f}}")
"""


def start(imports: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE.format(imports=imports)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=one_thread_env())


def seconds(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a measured process failed (exit {proc.returncode})")
    return float(next(line.split()[1] for line in out.splitlines()
                      if line.startswith("SECONDS")))


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "runs": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="processes started at once")
    args = p.parse_args()

    alone: dict[str, list[float]] = {name: [] for name in STAGES}
    together: list[float] = []  # slowest of `ranks` processes importing the rank's modules
    for _ in range(args.runs):  # stages alternate, run after run
        for name, imports in STAGES.items():
            alone[name].append(seconds(start(imports)))
        procs = [start(STAGES["+ longctx loop"]) for _ in range(args.ranks)]
        together.append(max(seconds(proc) for proc in procs))

    rows = {f"{name}, one process": spread(v) for name, v in alone.items()}
    rows[f"+ longctx loop, {args.ranks} processes at once (slowest)"] = spread(together)
    width = max(map(len, rows))
    print(f"{'imports, from process creation':<{width}}  s (min / median / max)")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['min']:.2f} / {row['median']:.2f} / {row['max']:.2f}")
    save_record("startup-floor", {
        "command": " ".join(["benchmarks/startup_floor.py", *sys.argv[1:]]),
        "python": platform.python_version(), "ranks": args.ranks, "rows": rows})


if __name__ == "__main__":
    main()

"""Rerun the bundled example (README Quickstart) for several seeds and thread counts, and
rewrite its results section in docs/results.md and the heatmap from what it measures.

    python benchmarks/example.py --readme     # seeds: the config's own, then 1-5; threads 1, 2

Each run is exactly what a user types, `longctx train examples/tiny_passkey.yaml
--nproc-per-node 2 --overwrite` then `longctx eval ... --checkpoint <out>/final`, on a copy
of the config whose `seed` (model init and data) and `output_dir` differ, with
OMP_NUM_THREADS set to the compute threads per rank (the launcher keeps a value the user
set). Results go to `benchmarks/results/example-<tag>.json` (one record per run, written
after every run so a long sweep can be read while it goes); `--readme` then rewrites the
part of docs/results.md between the `example-results` markers and
`docs/images/tiny_passkey_heatmap.png` (mean accuracy per cell over every run), so the
example's numbers always come from this script. `--from-json` redraws them from a saved file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from common import RESULTS, ROOT, cpu_words, machine, markdown_table, metrics_records, write_results

EXAMPLE = ROOT / "examples" / "tiny_passkey.yaml"
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"  # where the example's results section is
HEATMAP = ROOT / "docs" / "images" / "tiny_passkey_heatmap.png"
START, END = "<!-- example-results:start -->", "<!-- example-results:end -->"
FLOOR = 0.9  # the README's promise: retrieval at the trained lengths in >= 90% of samples


def _example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def trained_max_length(config: dict[str, Any]) -> int:
    """The longest passkey document the example trains on."""
    return max(max(d["context_lengths"]) for d in config["datasets"] if d["type"] == "passkey")


def accuracy_at(cells: list[dict[str, Any]], lengths: set[int]) -> float:
    """Share of correct keys over the eval grid's cells at `lengths` (passkey.json cells)."""
    mine = [c for c in cells if c["context_len"] in lengths]
    return sum(c["correct"] for c in mine) / max(1, sum(c["total"] for c in mine))


def eval_cells(
    config: dict[str, Any], root: Path = ROOT
) -> tuple[list[dict[str, Any]], set[int]]:
    """The passkey grid's cells `longctx eval` wrote for `config`, and the trained lengths
    among them (`output_dir` relative to `root`, where the run started)."""
    grid = json.loads((root / config["output_dir"] / "eval" / "passkey.json").read_text())
    cells = grid["models"][0]["cells"]
    longest = trained_max_length(config)
    return cells, {c["context_len"] for c in cells if c["context_len"] <= longest}


def _load() -> tuple[float, float]:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return float("nan"), float("nan")
    return one, five


def _longctx(args: list[str], threads: int, log: Path) -> float:
    """Run `longctx <args>` from this checkout as a user would; its wall time in seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "longctx_cli", *args], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"longctx {' '.join(args)} exited {code}; see {log}")
    return time.perf_counter() - started


def run_example(seed: int, threads: int, workdir: Path) -> dict[str, Any]:
    """Train and evaluate the example once; one JSON-able record of what it measured."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = _example()
    config["seed"] = seed
    config["output_dir"] = str(workdir / "out")
    config_path = workdir / "tiny_passkey.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    load_before = _load()
    train_s = _longctx(["train", str(config_path), "--nproc-per-node", "2", "--overwrite"],
                       threads, workdir / "train.log")
    final = Path(config["output_dir"]) / "final"
    eval_s = _longctx(["eval", str(config_path), "--checkpoint", str(final),
                       "--nproc-per-node", "2"], threads, workdir / "eval.log")
    cells, trained = eval_cells(config)
    metrics = metrics_records(Path(config["output_dir"]))
    lengths = sorted({c["context_len"] for c in cells})
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    return {
        "seed": seed,
        "threads_per_rank": threads,
        "train_s": round(train_s, 1),
        "eval_s": round(eval_s, 1),
        "command_s": round(train_s + eval_s, 1),
        "steps": len(metrics),
        "first_loss": metrics[0]["loss"],
        "final_loss": metrics[-1]["loss"],
        "final_eval_loss": evals[-1] if evals else None,
        "trained_lengths": sorted(trained),
        "trained_accuracy": accuracy_at(cells, trained),
        "accuracy_by_length": {str(n): accuracy_at(cells, {n}) for n in lengths},
        "overall_accuracy": accuracy_at(cells, set(lengths)),
        "cells": cells,
        "load_1min_before": round(load_before[0], 2),
        "load_1min_after": round(_load()[0], 2),
    }


# ---- README and heatmap ---------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if round(100 * x) == 100 * x or x in (0.0, 1.0) else f"{100 * x:.1f}%"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def readme_section(data: dict[str, Any]) -> str:
    """The example's results section (docs/results.md), every number from `data`."""
    runs = data["runs"]
    config = data["config"]
    cores = data["machine"]["cpu_count"]
    loads = [r["load_1min_before"] for r in runs] + [r["load_1min_after"] for r in runs]
    shared = max(loads) > 0.5 * cores
    where = cpu_words(data["machine"]) + (
        f", shared (1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs)"
        if shared else ", otherwise idle")
    trained = [r["trained_accuracy"] for r in runs]
    lengths = list(runs[0]["accuracy_by_length"])
    trained_lengths = runs[0]["trained_lengths"]
    beyond = [n for n in lengths if int(n) not in trained_lengths]
    threads = sorted({r["threads_per_rank"] for r in runs})
    n_runs = f"{len(runs)} run" + "s" * (len(runs) > 1)
    met = sum(t >= FLOOR for t in trained)
    # Per thread count: a sweep may have run fewer seeds at one setting than at another.
    def seeds_with(n: int) -> str:
        seeds = [str(r["seed"]) for r in runs if r["threads_per_rank"] == n]
        return f"seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}"

    which = "; ".join(f"{seeds_with(n)} with {n} compute thread{'s' * (n > 1)} per rank"
                      for n in threads)
    lines = [
        START,
        f"Measured by `python benchmarks/example.py` ({n_runs}: {which}; {where}; "
        f"{data['date']}; raw data `{data['json']}`):",
        "",
        f"- **Retrieval at the trained lengths** ({' and '.join(map(str, trained_lengths))} "
        f"tokens, every depth): **{_pct(min(trained))} to {_pct(max(trained))}** of samples "
        f"over the {n_runs}; {met} of {len(runs)} reach "
        f"the {_pct(FLOOR)} floor that `tests/test_quickstart.py` (slow) checks. Chance "
        f"is 1 in {9 * 10 ** (config['key_length'] - 1):,}.",
    ]
    for n in beyond:
        values = [r["accuracy_by_length"][n] for r in runs]
        stops = ": retrieval stops at the lengths the model was trained on, which is what the " \
            "grid is there to show" if max(values) < 0.5 else ""
        lines.append(f"- At {n} tokens, beyond the trained lengths, {_pct(min(values))} to "
                     f"{_pct(max(values))}{stops}.")
    for n in threads:
        mine = [r for r in runs if r["threads_per_rank"] == n]
        trains = [r["train_s"] for r in mine]
        commands = [r["command_s"] for r in mine]
        crowded = (f" (2 ranks x {n} threads on {cores} cores: more threads than cores, so "
                   "slower, not faster)" if 2 * n > cores else "")
        lines.append(
            f"- Time with {n} thread{'s' * (n > 1)} per rank{crowded}: training "
            f"{_minutes(min(trains))} to {_minutes(max(trains))}; the first Quickstart "
            f"command without the install (train + eval) {_minutes(min(commands))} to "
            f"{_minutes(max(commands))}, median {_minutes(statistics.median(commands))}.")
    lines += [
        f"- Loss: from {runs[0]['first_loss']:.2f} at step 1 to "
        f"{min(r['final_loss'] for r in runs):.4f}-{max(r['final_loss'] for r in runs):.4f} "
        f"at step {runs[0]['steps']:,}.",
        "",
    ]
    rows = []
    for r in sorted(runs, key=lambda r: (r["threads_per_rank"], r["seed"])):
        held = "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
        rows.append([r["seed"], r["threads_per_rank"], _pct(r["trained_accuracy"]),
                     *(_pct(r["accuracy_by_length"][n]) for n in lengths),
                     _pct(r["overall_accuracy"]), held, f"{r['command_s']:.0f} s"])
    lines += [
        markdown_table(["seed", "threads/rank", "trained lengths",
                        *(f"{n} tokens" for n in lengths), "overall", "final held-out loss",
                        "train + eval"], rows),
        "",
        "![passkey heatmap of the bundled example, mean over the runs above]"
        "(images/tiny_passkey_heatmap.png)",
        END,
    ]
    return "\n".join(lines)


def rewrite_readme(section: str, readme: Path = README, start: str = START,
                   end: str = END) -> None:
    """Replace the part of `readme` from `start` to `end` (markers included) by `section`."""
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + section + tail)


def draw_heatmap(runs: list[dict[str, Any]], path: Path) -> None:
    """Mean accuracy per (length, depth) cell over every run, with the worst run's value."""
    from matplotlib.figure import Figure

    lengths = sorted({c["context_len"] for c in runs[0]["cells"]})
    depths = sorted({c["depth"] for c in runs[0]["cells"]})

    def values(n: int, d: float) -> list[float]:
        return [c["correct"] / c["total"] for r in runs for c in r["cells"]
                if c["context_len"] == n and c["depth"] == d and c["total"]]

    fig = Figure(figsize=(5.5, 4.2), layout="constrained")
    ax = fig.subplots()
    mean = [[statistics.mean(values(n, d)) for n in lengths] for d in depths]
    image = ax.imshow(mean, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for row, d in enumerate(depths):
        for col, n in enumerate(lengths):
            v = values(n, d)
            ax.text(col, row, f"{statistics.mean(v):.0%}\nmin {min(v):.0%}", ha="center",
                    va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"tiny_passkey: mean over {len(runs)} run{'s' * (len(runs) > 1)} "
                 "(seeds x threads)")
    fig.colorbar(image, ax=ax, label="passkey accuracy")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="default: the config's own seed (what a user's run gets), then 1-5")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="compute threads per rank (OMP_NUM_THREADS)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "outputs" / "example_bench")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default benchmarks/results/example-<date>.json)")
    parser.add_argument("--readme", action="store_true",
                        help="rewrite docs/results.md's results section and the heatmap image")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="skip the runs: redraw the section and heatmap from this file")
    parser.add_argument("--append", action="store_true",
                        help="add the runs to an existing --out file instead of starting anew")
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = [_example()["seed"], 1, 2, 3, 4, 5]

    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
    elif args.append:
        if args.out is None or not args.out.exists():
            raise SystemExit("--append needs --out naming an existing results file")
        data = json.loads(args.out.read_text())
        out = args.out
    else:
        date = time.strftime("%Y-%m-%d")
        out = args.out or RESULTS / f"example-{date}.json"
        config = _example()
        data = {
            "date": date,
            "json": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
            "machine": machine(),
            "config": {"path": str(EXAMPLE.relative_to(ROOT)),
                       "key_length": config["datasets"][0]["key_length"],
                       "max_steps": config["max_steps"]},
            "floor": FLOOR,
            "runs": [],
        }
    if args.from_json is None:
        for threads in args.threads:
            for seed in args.seeds:
                record = run_example(seed, threads, args.workdir / f"seed{seed}-t{threads}")
                data["runs"].append(record)
                write_results(out, data)  # after every run
                print(f"seed {seed} threads {threads}: trained lengths "
                      f"{_pct(record['trained_accuracy'])}, overall "
                      f"{_pct(record['overall_accuracy'])}, train {record['train_s']:.0f} s, "
                      f"eval {record['eval_s']:.0f} s", flush=True)
    failed = [r for r in data["runs"] if r["trained_accuracy"] < FLOOR]
    if args.readme:
        rewrite_readme(readme_section(data), RESULTS_DOC)
        draw_heatmap(data["runs"], HEATMAP)
        print(f"rewrote {RESULTS_DOC.relative_to(ROOT)} and {HEATMAP.relative_to(ROOT)}")
    if failed:
        print(f"{len(failed)} run(s) below the {_pct(FLOOR)} floor: "
              + ", ".join(f"seed {r['seed']} threads {r['threads_per_rank']}" for r in failed))
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Time the README's first Quickstart command as a newcomer meets it: a fresh clone and a
fresh virtualenv, then the command exactly as the README writes it.

    python benchmarks/quickstart.py --readme

The command is read from the README's Quickstart block (its first command, over the lines it
continues onto) and run part by
part (`install && train && eval && generate`), each in the new virtualenv from the
clone's root, so the time of each part is known; the parts are the README's text, nothing
else. The clone is of this checkout's HEAD (commit your changes first). The virtualenv does
not see this machine's site-packages, so the install is a real one (pip's cache and the
machine's wheel mirrors, if any, are used as a newcomer's pip would use them). Results go to
`benchmarks/results/quickstart-<date>.json`; `--readme` rewrites the README line between the
`quickstart-time` markers from them.

    python benchmarks/quickstart.py --record-run

records one run instead, the one whose output the docs show: the README's train, eval and
generate commands in a fresh clone of HEAD (this machine's Python, the clone's source), the
whole train log to `benchmarks/results/train-tiny_passkey-<date>.log`, and what eval and
generate wrote and printed, with the machine and its load, to
`benchmarks/results/quickstart-run-<date>.json`. `benchmarks/figures.py` writes the shown
log and the eval grid from those two files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from common import RESULTS, ROOT, cpu_words, machine, markdown_table, write_results

from benchmarks.example import _load, accuracy_at, eval_cells, rewrite_readme
from benchmarks.example_after import PROMPT_KEY

README = ROOT / "README.md"
START, END = "<!-- quickstart-time:start -->", "<!-- quickstart-time:end -->"
BUDGET_S = 300  # the promise: the first Quickstart command within 5 minutes on 2 cores


def quickstart_command(readme: Path = README) -> str:
    """The first command of the README's Quickstart code block: its first line and the lines
    it continues onto (`\\` at a line's end), as one line."""
    text = readme.read_text()
    block = re.search(r"^## Quickstart\n(?:(?!^## ).)*?```bash\n(pip install.*?)```", text,
                      re.S | re.M)
    if block is None:
        raise SystemExit(f"{readme}: no ```bash block starting `pip install` under "
                         "'## Quickstart'")
    first = re.match(r"(?:[^\n]*\\\n)*[^\n]*", block.group(1)).group(0)
    return " ".join(first.replace("\\\n", " ").split())


def _first_output(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from start to the first line `command` prints, and to its exit (which must be
    0); what a user waits before seeing an answer, and in all."""
    started = time.perf_counter()
    first = None
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for _ in proc.stdout:
            if first is None:
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` exited {proc.returncode}")
    return round(first if first is not None else total, 2), round(total, 2)


def run_quickstart(workdir: Path) -> dict[str, Any]:
    """Clone, make a virtualenv, run each part of the command; one JSON-able record."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    clone, venv = workdir / "clone", workdir / "venv"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    command = quickstart_command()
    parts = []
    load_before = _load()
    for part in (p.strip() for p in command.split("&&")):
        log = workdir / f"part{len(parts)}.log"
        started = time.perf_counter()
        with log.open("w") as out:
            code = subprocess.run(["bash", "-c", part], cwd=clone, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, check=False).returncode
        seconds = time.perf_counter() - started
        parts.append({"command": part, "seconds": round(seconds, 1), "exit": code})
        if part.startswith("longctx generate"):  # its stdout's last line is the answer
            parts[-1]["printed_key"] = PROMPT_KEY in log.read_text().strip().splitlines()[-1]
        print(f"{seconds:7.1f} s  exit {code}  {part}", flush=True)
        if code != 0:
            raise SystemExit(f"`{part}` exited {code}; see {log}")
    cli = {"help_s": _first_output(["longctx", "--help"], clone, env)[1]}
    cli["validate_first_output_s"], cli["validate_s"] = _first_output(
        ["longctx", "validate", "examples/tiny_passkey.yaml"], clone, env)
    print(f"longctx --help {cli['help_s']:.2f} s; validate first output after "
          f"{cli['validate_first_output_s']:.2f} s, done in {cli['validate_s']:.1f} s", flush=True)
    # What the run learnt, read the way benchmarks/example.py reads it.
    config = yaml.safe_load((clone / "examples" / "tiny_passkey.yaml").read_text())
    cells, trained = eval_cells(config, clone)
    return {
        "commit": commit,
        "command": command,
        "seed": config["seed"],
        "trained_accuracy": accuracy_at(cells, trained),
        "parts": parts,
        "cli": cli,
        "total_s": round(sum(p["seconds"] for p in parts), 1),
        "load_1min_before": round(load_before[0], 2),
        "load_1min_after": round(_load()[0], 2),
    }


def _column(data: dict[str, Any]) -> list[str]:
    """One machine's cells of the README's table, row by row."""
    runs = data["runs"]
    totals = [r["total_s"] for r in runs]
    installs = sorted(round(r["parts"][0]["seconds"]) for r in runs)
    install = (f"{installs[0]} s" if installs[0] == installs[-1]
               else f"{installs[0]}-{installs[-1]} s")
    span = (f"{min(totals) / 60:.1f} min" if len(runs) == 1
            else f"{min(totals) / 60:.1f} to {max(totals) / 60:.1f} min")
    keys = [p["printed_key"] for r in runs for p in r["parts"] if "printed_key" in p]
    return [f"{cpu_words(data['machine'])}, {len(runs)} run{'s' * (len(runs) > 1)}", span,
            install, ", ".join(f"{100 * r['trained_accuracy']:.1f}%" for r in runs),
            f"{sum(keys)} of {len(keys)} runs"]


def cpu_vendor(machine: dict[str, Any]) -> str:
    """`intel`, `amd` or `cpu`: what tells two machines' results files apart."""
    model = str(machine.get("cpu_model") or "").lower()
    return next((v for v in ("intel", "amd") if v in model), "cpu")


def readme_line(measured: list[dict[str, Any]]) -> str:
    """The README's table of the first Quickstart command's runs (between the markers): one
    column per machine measured, since the same seed trains differently on different CPUs."""
    seeds = {r["seed"] for data in measured for r in data["runs"]}
    labels = ["from a fresh clone and virtualenv", "the first command, in all",
              "of which the install (pip's cache and the machine's wheel mirror)",
              f"retrieval at the trained lengths (seed {min(seeds)}, the config's)",
              f"`longctx generate` printed the key `{PROMPT_KEY}`"]
    columns = [_column(data) for data in measured]
    rows = [[label, *(c[i] for c in columns)] for i, label in enumerate(labels)]
    sources = "; ".join(f"{data['date']} (`{data['json']}`)" for data in measured)
    lines = [START, markdown_table(rows[0], rows[1:]), "",
             f"Timed by `python benchmarks/quickstart.py`: {sources}."]
    if len(measured) > 1:
        lines.append("Each CPU's float kernels round differently, so the same seed trains a "
                     "slightly different model on each.")
    return "\n".join([*lines, END])


def record_run() -> Path:
    """One run of the README's train, eval and generate commands, recorded for the docs."""
    date = time.strftime("%Y-%m-%d")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    command = quickstart_command()
    commands = [p.strip() for p in command.split("&&") if p.strip().startswith("longctx ")]
    with tempfile.TemporaryDirectory(prefix="longctx-run-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TERM")}
        env.update(PYTHONPATH=str(clone), HF_HUB_OFFLINE="1", NO_COLOR="1")
        printed, seconds, loads = {}, {}, [round(_load()[0], 2)]
        for part in commands:
            args = part.split()[1:]
            started = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "longctx_cli", *args], cwd=clone,
                                    env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, check=False)
            seconds[args[0]] = round(time.perf_counter() - started, 1)
            loads.append(round(_load()[0], 2))
            printed[args[0]] = result.stdout
            print(f"{seconds[args[0]]:7.1f} s  exit {result.returncode}  {part}", flush=True)
            if result.returncode != 0:
                raise SystemExit(f"`{part}` exited {result.returncode}:\n{result.stdout}")
        config = yaml.safe_load((clone / "examples" / "tiny_passkey.yaml").read_text())
        evals = clone / config["output_dir"] / "eval"
        passkey = json.loads((evals / "passkey.json").read_text())
        position_loss = json.loads((evals / "position_loss.json").read_text())
    log = RESULTS / f"train-tiny_passkey-{date}.log"
    log.write_text(printed["train"])
    return write_results(RESULTS / f"quickstart-run-{date}.json", {
        "commands": commands, "commit": commit, "date": date,
        "machine": f"{cpu_words(machine())}, 1-minute load average "
                   f"{min(loads):.1f}-{max(loads):.1f} (other work shared it)",
        "load_1min": loads, "seconds": seconds,
        "train_log": str(log.relative_to(ROOT)), "seed": config["seed"],
        "passkey": passkey, "position_loss": position_loss,
        "generate_printed": printed["generate"].strip().splitlines()[-1],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--readme", action="store_true",
                        help="rewrite README.md's quickstart-time line")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="skip the runs: rewrite the README line from this file")
    parser.add_argument("--record-run", action="store_true",
                        help="record one run's train log, eval and generate output for the docs")
    args = parser.parse_args()
    if args.record_run:
        print(f"wrote {record_run().relative_to(ROOT)}")
        return
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
    else:
        date = time.strftime("%Y-%m-%d")
        out = RESULTS / f"quickstart-{date}-{cpu_vendor(machine())}.json"
        data = {"date": date, "json": str(out.relative_to(ROOT)), "machine": machine(),
                "budget_s": BUDGET_S, "runs": []}
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="longctx-quickstart-") as tmp:
                data["runs"].append(run_quickstart(Path(tmp)))
            write_results(out, data)
            print(f"total {data['runs'][-1]['total_s']:.0f} s", flush=True)
    if args.readme:
        rewrite_readme(readme_line([data]), README, START, END)
        print(f"rewrote {README.relative_to(ROOT)}")
    over = [r["total_s"] for r in data["runs"] if r["total_s"] > BUDGET_S]
    if over:
        print(f"{len(over)} run(s) over the {BUDGET_S} s budget: {over}")
        sys.exit(1)


if __name__ == "__main__":
    main()

"""What the benchmarks share: where they are, the machine they ran on, their Markdown tables,
their results files and their ranks.

A benchmark runs as `python benchmarks/<name>.py` from the repository's root. Python's path
then starts at this folder, not at the root, so a benchmark imports this module first, by its
own name (`from common import ...`, which ruff sorts before the repository's imports), and
importing it puts the root on the path: the benchmarks then import each other as
`benchmarks.<name>`, the tests' helpers as `tests.<name>`, and this checkout's `longctx_cli`.
The tests see this folder as the scripts do (`pythonpath` in pyproject.toml).

Only the standard library is imported here at first: `--table` runs and `figures.py` need
neither torch nor the package.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after this folder, before the installed packages


# ---- the machine and a process's memory -----------------------------------------------------


def cpu_model() -> str | None:
    """The CPU's name as Linux reports it (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), None)


def machine() -> dict[str, Any]:
    """This machine, as a results file records it."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cpu_words(facts: dict[str, Any]) -> str:
    """"2-core CPU (Intel Xeon ...)": a `machine()` record as the docs name it."""
    model = facts.get("cpu_model")
    return f"{facts['cpu_count']}-core CPU" + (f" ({model})" if model else "")


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> int:
    """Start this process's resident-set high-water mark (VmHWM) again from its resident set,
    and return that: `peak_bytes() - reset_peak()` is what a step between them added."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_bytes(pid: int | str = "self") -> int:
    """The resident-set high-water mark (VmHWM) of process `pid` (this one by default)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


# ---- tables and results files --------------------------------------------------------------


def markdown_table(head: Sequence[object], rows: Iterable[Sequence[object]],
                   right: Collection[int] = ()) -> str:
    """A Markdown table: the `head` cells, the rule (the columns numbered in `right` aligned
    right), then one line per row; each cell as `str` gives it, one space either side."""
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(head)))
    return "\n".join([line(head), rule, *map(line, rows)])


def span(values: Iterable[float], fmt: str, unit: str = "") -> str:
    """`lo-hi` (or `lo` where both format alike) of `values`, each formatted with `fmt`."""
    values = list(values)
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def shown(path: Path) -> str:
    """`path` as a message names it: from the repository's root when it is inside."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_results(path: Path, data: Any) -> Path:
    """`data` as a results file at `path` (its folder made): JSON indented by two, one final
    newline. A run may call it after every measurement; the last call wins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def save_record(stem: str, record: dict, out: Path | None = None) -> Path:
    """`record` with the date and the machine ("x86_64, 2 cores"), as
    `benchmarks/results/<stem>-<date>.json` (or `out`); prints where."""
    date = time.strftime("%Y-%m-%d")
    facts = machine()
    path = write_results(out or RESULTS / f"{stem}-{date}.json", {
        **record, "date": date, "machine": f"{facts['processor']}, {facts['cpu_count']} cores"})
    print(f"wrote {shown(path)}")
    return path


def metrics_records(output_dir: Path) -> list[dict]:
    """The records `longctx train` wrote to `output_dir`/metrics.jsonl, one a line."""
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def alternating_runs(configs: dict[bool, Path], runs: int, work: Path,
                     one_run: Callable[[Path, Path], dict],
                     describe: Callable[[dict], str]) -> dict[bool, list[dict]]:
    """`one_run(config, log)` for each of two configs (feature off / on), `runs` times in
    turn so that load drifts hit both; prints `describe(result)` after each run."""
    results: dict[bool, list[dict]] = {on: [] for on in configs}
    for run in range(runs):
        for on, path in configs.items():
            result = one_run(path, work / f"{path.stem}-run{run}.log")
            results[on].append(result)
            print(f"run {run} {path.stem}: {describe(result)}", flush=True)
    return results


def same_losses(off: Sequence[float], on: Sequence[float], rel: float,
                floor: float = 0.0) -> None:
    """Exits naming the first step where the two runs' losses differ by more than `rel` of
    the loss (or of `floor`, if larger): a saving that changes the losses is not one."""
    for a, b in zip(off, on, strict=True):
        if abs(a - b) > rel * max(abs(a), floor):
            raise SystemExit(f"the runs' losses differ: {a} vs {b}")


# ---- ranks and rounds ----------------------------------------------------------------------


def run_ranks(worker: Callable[..., Any], world: int, *args: Any,
              timeout_s: float = math.inf) -> list[Any]:
    """`worker(rank, world, *args)` on `world` processes of one compute thread each, joined in
    a gloo group: the tests' `run_distributed` (tests/distributed.py), here with no time limit
    unless `timeout_s` sets one. The workers' return values, in rank order.

    The processes are forks of a server that the first call starts with this process's
    environment as it is then: set what the ranks' C libraries read at their start
    (`MALLOC_MMAP_THRESHOLD_`) before the first call."""
    from tests.distributed import run_distributed

    return run_distributed(worker, world, *args, timeout_s=timeout_s)


def rounds(items: Sequence[Any], repeats: int, stride: int = 1) -> Iterator[tuple[int, Any]]:
    """(round, item): every item once per round, each round's order rotated by `stride` items
    from the last's, so that no item is always measured first while the machine's load
    drifts."""
    items = list(items)
    for r in range(repeats):
        shift = (r * stride) % len(items)
        for item in items[shift:] + items[:shift]:
            yield r, item

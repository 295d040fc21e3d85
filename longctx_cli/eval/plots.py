"""PNG plots of the eval results and the training loss.

matplotlib is a default dependency; without it (a trimmed environment) the plots are skipped
with a note and everything else is still written.

The figures are drawn on `matplotlib.figure.Figure` directly, without pyplot, so no GUI
backend and no global figure state are involved.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from longctx_cli.eval.passkey_grid import GridResult
from longctx_cli.eval.position_loss import PositionLoss
from longctx_cli.eval.ruler_eval import RulerResult

SKIPPED_NOTE = "matplotlib is not installed: PNG plots skipped (pip install matplotlib)."


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):  # -> Figure; matplotlib is optional
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def passkey_heatmap(results: list[tuple[str, GridResult]], path: Path) -> bool:
    """Accuracy per (context length, depth), one panel per model; False when skipped."""
    if not have_matplotlib():
        return False
    fig = _figure(4.5 * len(results) + 1.0, 4.0)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    image = None
    for ax, (label, grid) in zip(axes, results, strict=True):
        lengths, depths = grid.spec.context_lengths, grid.spec.depths
        matrix = [[_cell_accuracy(grid, n, d) for n in lengths] for d in depths]
        image = ax.imshow(matrix, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for row, depth_values in enumerate(matrix):
            for col, value in enumerate(depth_values):
                text = "-" if math.isnan(value) else f"{value:.0%}"
                ax.text(col, row, text, ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{label}: {grid.accuracy:.0%}")
    fig.colorbar(image, ax=list(axes), label="passkey accuracy")
    fig.savefig(path, dpi=120)
    return True


def _cell_accuracy(grid: GridResult, context_len: int, depth: float) -> float:
    correct, total = grid.cell(context_len, depth)
    return correct / total if total else math.nan


def position_loss_plot(results: list[tuple[str, PositionLoss]], path: Path) -> bool:
    """Mean loss per position bucket, one line per model; False when skipped."""
    if not have_matplotlib():
        return False
    fig = _figure(7.0, 4.0)
    ax = fig.subplots()
    for label, losses in results:
        centres = [(a + b - 1) / 2 for a, b in zip(losses.starts, losses.ends, strict=True)]
        ax.plot(centres, losses.mean, marker="o", markersize=3, label=label)
    ax.set_xlabel("position in document (tokens)")
    ax.set_ylabel("mean next-token loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return True


def ruler_plot(results: list[tuple[str, RulerResult]], path: Path) -> bool:
    """Score vs context length, one line per task and the average in bold, one panel per
    model; False when skipped."""
    if not have_matplotlib():
        return False
    fig = _figure(5.5 * len(results) + 1.5, 4.0)
    axes = fig.subplots(1, len(results), squeeze=False, sharey=True)[0]
    for ax, (label, ruler) in zip(axes, results, strict=True):
        lengths = ruler.spec.lengths
        for task in ruler.spec.tasks:
            scores = [ruler.score(task, n) for n in lengths]
            ax.plot(lengths, [math.nan if v is None else v for v in scores], marker="o",
                    markersize=3, linewidth=1, label=task)
        ax.plot(lengths, [ruler.average(n) for n in lengths], color="black", linewidth=2.5,
                label="average")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{label}: RULER average {ruler.average():.0%}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("score")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.savefig(path, dpi=120)
    return True


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line torn by a kill mid-write is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def loss_curve_plot(metrics_path: Path, path: Path) -> bool:
    """Training loss per step (and held-out loss where logged) from metrics.jsonl, log scale;
    False when skipped (no matplotlib, no metrics)."""
    if not have_matplotlib() or not metrics_path.is_file():
        return False
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records
             if isinstance(r.get("loss"), (int, float)) and r["loss"] > 0]
    if not train:
        return False
    held_out = [(r["step"], r["eval_loss"]) for r in records
                if isinstance(r.get("eval_loss"), (int, float)) and r["eval_loss"] > 0]
    fig = _figure(7.0, 4.0)
    ax = fig.subplots()
    ax.plot(*zip(*train, strict=True), linewidth=0.8, label="train loss")
    if held_out:
        ax.plot(*zip(*held_out, strict=True), marker="o", label="held-out loss")
    ax.set_yscale("log")  # the interesting part is the last decade or two
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return True

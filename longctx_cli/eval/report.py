"""What `longctx eval` shows and writes: rich tables, JSON, CSV and the PNGs."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from longctx_cli.eval import plots
from longctx_cli.eval.passkey_grid import EVAL_SEED, GridResult
from longctx_cli.eval.position_loss import PositionLoss
from longctx_cli.eval.ruler_eval import RULER_SEED, RulerResult

METRIC = "teacher_forced_exact_match"


@dataclass
class ModelResult:
    """One checkpoint's results; None where `eval_tasks` did not choose that evaluation."""

    label: str
    checkpoint: str
    grid: GridResult | None
    positions: PositionLoss | None
    ruler: RulerResult | None = None


def model_labels(paths: list[Path]) -> list[str]:
    """Short names for the table headers: `run/final`, made unique when two paths agree."""
    labels = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    return labels


# ---- terminal ------------------------------------------------------------------------------


def _colour(share: float) -> str:
    return "green" if share >= 0.8 else "yellow" if share >= 0.4 else "red"


def _styled(correct: int, total: int) -> str:
    return f"[{_colour(correct / total if total else 0.0)}]{correct}/{total}[/]"


def _styled_share(share: float | None) -> str:
    return "-" if share is None else f"[{_colour(share)}]{share:.0%}[/]"


def passkey_table(results: list[ModelResult]) -> Table:
    """Rows: depths; columns: context lengths; cells `correct/total` per model."""
    spec = results[0].grid.spec
    table = Table(title="passkey retrieval (exact match of the key)")
    table.add_column("depth", justify="right")
    for length in spec.context_lengths:
        table.add_column(f"{length} tok", justify="center")
    for depth in spec.depths:
        cells = [" -> ".join(_styled(*r.grid.cell(length, depth)) for r in results)
                 for length in spec.context_lengths]
        table.add_row(f"{depth:.0%}", *cells)
    table.caption = "correct/total per cell" + (", first -> second model" if len(results) > 1
                                                 else "") + "; overall: " + ", ".join(
        f"{r.label} {r.grid.accuracy:.1%}" for r in results)
    return table


def ruler_table(results: list[ModelResult]) -> Table:
    """Rows: RULER tasks and their average; columns: lengths; cells: score per model."""
    spec = results[0].ruler.spec
    table = Table(title="RULER (greedy generation, string match)")
    table.add_column("task")
    for length in spec.lengths:
        table.add_column(f"{length} tok", justify="center")

    def cell(values: list[float | None]) -> str:
        return " -> ".join(map(_styled_share, values))

    for task in spec.tasks:
        table.add_row(task, *[cell([r.ruler.score(task, n) for r in results])
                              for n in spec.lengths])
    table.add_row("[bold]average[/]", *[cell([r.ruler.average(n) for r in results])
                                        for n in spec.lengths])
    table.caption = (f"{spec.samples} samples per cell"
                     + (", first -> second model" if len(results) > 1 else "")
                     + "; RULER average: " + ", ".join(f"{r.label} {r.ruler.average():.1%}"
                                                       for r in results))
    return table


def tables(results: list[ModelResult]) -> list[Table]:
    """The tables of the evaluations that ran, in a fixed order."""
    first = results[0]
    return ([passkey_table(results)] if first.grid is not None else []) + \
        ([position_table(results)] if first.positions is not None else []) + \
        ([ruler_table(results)] if first.ruler is not None else [])


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def position_table(results: list[ModelResult]) -> Table:
    """Mean loss per position bucket, one column per model (and the difference for two)."""
    table = Table(title="held-out loss by position in document")
    table.add_column("positions", justify="right")
    table.add_column("tokens", justify="right")
    for r in results:
        table.add_column(f"loss {r.label}", justify="right")
    if len(results) == 2:
        table.add_column("difference", justify="right")
    first = results[0].positions
    # Buckets past the longest held-out document hold nothing: leave them to the files.
    shown = max((i + 1 for i, n in enumerate(first.tokens) if n), default=len(first.tokens))
    for i, (start, end) in enumerate(zip(first.starts[:shown], first.ends[:shown], strict=True)):
        means = [r.positions.mean[i] for r in results]
        extra = [_fmt(means[1] - means[0])] if len(results) == 2 else []
        table.add_row(f"{start}-{end - 1}", str(first.tokens[i]), *map(_fmt, means), *extra)
    table.caption = "overall: " + ", ".join(
        f"{r.label} {_fmt(r.positions.overall)}" for r in results)
    if shown < len(first.tokens):
        table.caption += f"; no tokens at positions {first.starts[shown]} and beyond"
    return table


# ---- files ---------------------------------------------------------------------------------


def _json_safe(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_passkey_json(results: list[ModelResult], path: Path) -> None:
    spec = results[0].grid.spec
    data = {
        "metric": METRIC,
        "context_lengths": spec.context_lengths,
        "depths": spec.depths,
        "samples_per_cell": spec.samples_per_cell,
        "key_length": spec.key_length,
        "seed": EVAL_SEED,
        "models": [{"label": r.label, "checkpoint": r.checkpoint, **r.grid.to_dict()}
                   for r in results],
    }
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")


def write_position_files(results: list[ModelResult], sequence_len: int, directory: Path) -> None:
    data = {
        "position": "position of the input token in its document; its loss predicts the next",
        "sequence_len": sequence_len,
        "models": [{"label": r.label, "checkpoint": r.checkpoint, **r.positions.to_dict()}
                   for r in results],
    }
    (directory / "position_loss.json").write_text(json.dumps(_json_safe(data), indent=2) + "\n")
    with (directory / "position_loss.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "checkpoint", "bucket", "start", "end", "tokens", "loss"])
        for r in results:
            for row in r.positions.rows():
                loss = "" if row["loss"] is None else f"{row['loss']:.6f}"
                writer.writerow([r.label, r.checkpoint, row["bucket"], row["start"],
                                 row["end"], row["tokens"], loss])


def write_ruler_json(results: list[ModelResult], path: Path) -> None:
    spec = results[0].ruler.spec
    data = {
        "metric": "RULER string match (all: share of gold strings found; part: any found)",
        "tasks": spec.tasks,
        "lengths": spec.lengths,
        "samples_per_cell": spec.samples,
        "seed": RULER_SEED,
        "models": [{"label": r.label, "checkpoint": r.checkpoint, **r.ruler.to_dict()}
                   for r in results],
    }
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")


def write_all(results: list[ModelResult], sequence_len: int, directory: Path,
              metrics: Path | None = None) -> list[str]:
    """Write every output of the evaluations that ran into `directory` (+ the loss curve of
    `metrics`, the training run's metrics.jsonl, when it exists); lines to show the user."""
    directory.mkdir(parents=True, exist_ok=True)
    first = results[0]
    written: list[str] = []
    pictures: list[tuple[str, str, bool]] = []  # (what, file, written)
    if first.grid is not None:
        write_passkey_json(results, directory / "passkey.json")
        written.append("passkey.json")
        pictures.append(("passkey heatmap", "passkey_heatmap.png", plots.passkey_heatmap(
            [(r.label, r.grid) for r in results], directory / "passkey_heatmap.png")))
    if first.positions is not None:
        write_position_files(results, sequence_len, directory)
        written += ["position_loss.json", "position_loss.csv"]
        pictures.append(("loss by position", "position_loss.png", plots.position_loss_plot(
            [(r.label, r.positions) for r in results], directory / "position_loss.png")))
    if first.ruler is not None:
        write_ruler_json(results, directory / "ruler.json")
        written.append("ruler.json")
        pictures.append(("RULER scores", "ruler.png", plots.ruler_plot(
            [(r.label, r.ruler) for r in results], directory / "ruler.png")))
    curve = metrics is not None and plots.loss_curve_plot(metrics, directory / "loss_curve.png")
    pictures.append(("training loss curve", "loss_curve.png", curve))
    written += [name for _, name, ok in pictures if ok]
    lines = [f"wrote {directory}/: " + ", ".join(written)]
    # The pictures a newcomer looks for first, each on its own line with its full path.
    lines += [f"{what}: {directory / name}" for what, name, ok in pictures
              if ok and name != "position_loss.png"]
    if not plots.have_matplotlib():
        lines.append(plots.SKIPPED_NOTE)
    return lines

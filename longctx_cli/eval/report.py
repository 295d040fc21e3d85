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

METRIC = "teacher_forced_exact_match"


@dataclass
class ModelResult:
    label: str
    checkpoint: str
    grid: GridResult
    positions: PositionLoss


def model_labels(paths: list[Path]) -> list[str]:
    """Short names for the table headers: `run/final`, made unique when two paths agree."""
    labels = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    return labels


# ---- terminal ------------------------------------------------------------------------------


def _styled(correct: int, total: int) -> str:
    share = correct / total if total else 0.0
    colour = "green" if share >= 0.8 else "yellow" if share >= 0.4 else "red"
    return f"[{colour}]{correct}/{total}[/]"


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


def write_all(results: list[ModelResult], sequence_len: int, directory: Path,
              metrics: Path | None = None) -> list[str]:
    """Write every output into `directory` (+ the loss curve of `metrics`, the training
    run's metrics.jsonl, when it exists); return lines to show the user."""
    directory.mkdir(parents=True, exist_ok=True)
    write_passkey_json(results, directory / "passkey.json")
    write_position_files(results, sequence_len, directory)
    written = ["passkey.json", "position_loss.json", "position_loss.csv"]
    heatmap = plots.passkey_heatmap([(r.label, r.grid) for r in results],
                                    directory / "passkey_heatmap.png")
    line = plots.position_loss_plot([(r.label, r.positions) for r in results],
                                    directory / "position_loss.png")
    curve = metrics is not None and plots.loss_curve_plot(metrics, directory / "loss_curve.png")
    written += [name for name, ok in (("passkey_heatmap.png", heatmap),
                                      ("position_loss.png", line),
                                      ("loss_curve.png", curve)) if ok]
    lines = [f"wrote {directory}/: " + ", ".join(written)]
    # The pictures a newcomer looks for first, each on its own line with its full path.
    lines += [f"{what}: {directory / name}" for what, name, ok in (
        ("passkey heatmap", "passkey_heatmap.png", heatmap),
        ("training loss curve", "loss_curve.png", curve)) if ok]
    if not (heatmap and line):
        lines.append(plots.SKIPPED_NOTE)
    return lines

"""`longctx eval`: validate, then run torchrun with ourselves as the entry point.

Outside a torchrun environment the command checks the config, the checkpoint folder(s) and
the passkey grid, builds (or reuses) the data cache, and starts the same launch as `train`
with `-m longctx_cli eval ...`. Inside one, every rank loads the model(s) and evaluates:
each SP group runs one sequence-parallel forward per row, data-parallel groups split the
rows, and rank 0 prints the tables and writes `<output_dir>/eval/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config import Config, load_config
from longctx_cli.errors import UserError
from longctx_cli.eval.checkpoint_loading import check_intact, checkpoint_kind

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.eval.passkey_grid import GridSpec
    from longctx_cli.eval.report import ModelResult
    from longctx_cli.parallel.mesh import ParallelState


def _no_held_out() -> UserError:
    return UserError(
        "per-position loss needs held-out rows, and this config has none.",
        where="val_set_size",
        fix="set `val_set_size` (e.g. 0.05) or add `eval_datasets`.",
    )


def _launch_args(config_path: Path, checkpoint: Path, compare: Path | None) -> list[str]:
    args = ["eval", str(config_path), "--checkpoint", str(checkpoint)]
    return args + (["--compare", str(compare)] if compare is not None else [])


def run_eval(
    config_path: Path,
    checkpoint: Path,
    compare: Path | None,
    nproc_per_node: int | None,
) -> int:
    """Entry of `longctx eval`; returns the process exit code."""
    from longctx_cli.runtime.launch import in_torchrun, launch_torchrun, rank_errors

    # Evaluation runs the exported, unsharded model with SP only: a training run's
    # tensor_parallel_size does not apply (its ranks would otherwise slice the loss for TP).
    config = load_config(config_path).model_copy(update={"tensor_parallel_size": 1})
    if in_torchrun():
        with rank_errors():
            evaluate(config, checkpoint, compare)
        return 0

    for path in (checkpoint, compare):
        if path is not None:
            checkpoint_kind(path)
            check_intact(path)  # a damaged folder fails here, once, before any rank starts
    if not config.val_set_size and not config.eval_datasets:
        raise _no_held_out()
    # Forward only: SP so long rows fit; by default one SP group, more ranks add DP groups.
    world = nproc_per_node or config.sequence_parallel_degree
    _check_plan(config, world)

    from longctx_cli.data.prepare import prepare
    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.eval.passkey_grid import grid_spec

    tokenizer = load_tokenizer(config)
    grid_spec(config, tokenizer)  # an impossible grid fails here, before any rank starts
    if prepare(config, tokenizer).eval is None:
        raise _no_held_out()
    return launch_torchrun(_launch_args(config_path, checkpoint, compare), world, world)


def _check_plan(config: Config, world: int) -> None:
    """The rules `validate` applies (SP degree vs world, heads, kernel) for this world."""
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan

    build_plan(config, world, read_model_config(config), nproc_per_node=world,
               world_source=f"--nproc-per-node {world}")


def evaluate(config: Config, checkpoint: Path, compare: Path | None) -> None:
    """Inside torchrun, on every rank: evaluate the checkpoint(s) and write the results."""
    import torch.distributed as dist
    from rich.console import Console

    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
    from longctx_cli.eval import report
    from longctx_cli.eval.passkey_grid import grid_spec
    from longctx_cli.runtime.distributed import (
        init_distributed,
        init_parallel,
        load_rows,
    )

    device = init_distributed(config)
    state = init_parallel(config, device)
    rank = dist.get_rank()
    tokenizer = load_tokenizer(config)
    pad_id = tokenizer_pad_id(tokenizer)
    _, rows = load_rows(config, tokenizer)
    if rows is None:
        raise _no_held_out()
    spec = grid_spec(config, tokenizer)
    paths = [checkpoint] + ([compare] if compare is not None else [])
    results = [
        evaluate_model(config, path, label, spec, tokenizer, rows, state, pad_id, rank == 0)
        for path, label in zip(paths, report.model_labels(paths), strict=True)
    ]
    if rank == 0:
        console = Console()
        console.print(report.passkey_table(results))
        console.print(report.position_table(results))
        output_dir = Path(config.output_dir)
        for line in report.write_all(results, config.sequence_len, output_dir / "eval",
                                     output_dir / "metrics.jsonl"):
            # markup=False: rich would eat "[plots]"-like brackets in paths and hints.
            console.print(line, highlight=False, markup=False)
    dist.barrier()
    dist.destroy_process_group()


def evaluate_model(
    config: Config,
    path: Path,
    label: str,
    spec: GridSpec,
    tokenizer: PreTrainedTokenizerBase,
    rows: Dataset,
    state: ParallelState,
    pad_id: int,
    show_progress: bool,
) -> ModelResult:
    """Load one checkpoint and run both evaluations on it (collective: every rank calls)."""
    from longctx_cli.eval.checkpoint_loading import load_for_eval
    from longctx_cli.eval.passkey_grid import run_passkey_grid
    from longctx_cli.eval.position_loss import position_loss
    from longctx_cli.eval.report import ModelResult
    from longctx_cli.runtime.model import decoder_and_head

    model = load_for_eval(config, path).to(state.device)
    decoder, lm_head = decoder_and_head(model)
    grid = run_passkey_grid(decoder, lm_head, tokenizer, spec, state, pad_id, show_progress,
                            label)
    positions = position_loss(
        decoder, lm_head, rows, config.sequence_len, config.eval_position_buckets, state, pad_id,
        config.loss_chunk_size, show_progress, label,
    )
    return ModelResult(label, str(path.resolve()), grid, positions)

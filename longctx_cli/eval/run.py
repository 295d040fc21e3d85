"""`longctx eval`: validate, then run torchrun with ourselves as the entry point.

Outside a torchrun environment the command checks the config, the checkpoint folder(s) and
the evaluations `eval_tasks` chooses (passkey grid, held-out loss by position, RULER tasks),
builds (or reuses) the data cache when held-out rows are needed, and starts the same launch
as `train` with `-m longctx_cli.rank eval ...`. Inside one, every rank loads the model(s) and
evaluates: each SP group runs sequence-parallel forwards (and, for RULER, greedy decoding
from a sharded KV cache), data-parallel groups split the samples, and rank 0 prints the
tables and writes `<output_dir>/eval/`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config import Config, load_config
from longctx_cli.errors import UserError
from longctx_cli.eval.checkpoint_loading import check_intact, checkpoint_kind

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.plan import Plan
    from longctx_cli.eval.passkey_grid import GridSpec
    from longctx_cli.eval.report import ModelResult
    from longctx_cli.eval.ruler_eval import RulerSpec
    from longctx_cli.launcher.launch import EarlyTorchrun
    from longctx_cli.parallel.mesh import ParallelState


# Said when `position_loss` is skipped: the config holds no held-out rows, or (`rl:`) rows of
# preference pairs, whose loss by position means nothing.
NO_HELD_OUT = ("position_loss skipped: it needs held-out rows and this config has none "
               "(set `val_set_size`, e.g. 0.05, or add `eval_datasets`).")
PAIRS_HELD_OUT = ("position_loss skipped: the held-out rows are preference pairs; training "
                  "reports their loss and rewards (`eval_loss`, `eval_rewards/*` in "
                  "metrics.jsonl).")


PROMPTS_ONLY = ("position_loss skipped: `rl: grpo` trains on prompts, which hold no "
                "held-out text to score by position.")


def skipped_positions(config: Config) -> str:
    if config.objective.rl == "grpo":
        return PROMPTS_ONLY
    return PAIRS_HELD_OUT if config.objective.rl else NO_HELD_OUT


def _launch_args(config_path: Path, checkpoint: Path, compare: Path | None,
                 overrides: list[str]) -> list[str]:
    args = ["eval", str(config_path), "--checkpoint", str(checkpoint)]
    return args + (["--compare", str(compare)] if compare is not None else []) + overrides


@dataclass(frozen=True)
class EvalSpecs:
    """What `eval_tasks` asks for, checked: None where an evaluation is not chosen."""

    grid: GridSpec | None
    positions: bool
    ruler: RulerSpec | None


def eval_specs(config: Config, tokenizer: PreTrainedTokenizerBase,
               held_out: bool = True) -> EvalSpecs:
    """The evaluations of `eval_tasks`, each checked against the config and tokenizer (an
    impossible grid or task length fails here, before any rank starts). Without `held_out`
    rows `position_loss` is left out (the caller says so), unless it was all there was."""
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.eval.passkey_grid import default_lengths, grid_spec
    from longctx_cli.eval.ruler_eval import expand_tasks, ruler_spec

    others, ruler_tasks = expand_tasks(config.eval.eval_tasks)
    if not others and not ruler_tasks:
        raise UserError("`eval_tasks` is empty: nothing to evaluate.", where="eval_tasks",
                        fix="e.g. `eval_tasks: [passkey, position_loss, ruler]`.")
    ruler = None
    if ruler_tasks:
        shape = read_model_config(config)
        lengths = default_lengths(config.data.sequence_len)
        ruler = ruler_spec(config, tokenizer, ruler_tasks, lengths,
                           shape.max_position_embeddings)
    grid = grid_spec(config, tokenizer) if "passkey" in others else None
    positions = "position_loss" in others
    if positions and not held_out:
        if grid is None and ruler is None:
            raise UserError(skipped_positions(config).replace(
                " skipped:", " is all `eval_tasks` asks for, and"), where="eval_tasks",
                            fix="hold out rows as above, or add `passkey` or `ruler` to "
                            "`eval_tasks`.")
        positions = False
    return EvalSpecs(grid, positions, ruler)


def eval_tokenizer(config: Config) -> PreTrainedTokenizerBase:
    """The tokenizer evaluation reads with: a vision-language run's is its processor's (with
    the config's special tokens and pad token), as training and `longctx generate` read it."""
    from longctx_cli.data.tokenizer import run_tokenizer

    return run_tokenizer(config)[0]


def has_held_out(config: Config) -> bool:
    """Whether the config names held-out rows `position_loss` can read (the cache says
    whether it holds any); preference pairs (`rl:`) are not such rows."""
    data = config.data
    return bool(data.val_set_size or data.eval_datasets) and config.objective.rl is None


def import_rank_modules() -> None:
    """Import what an eval or generate rank runs (model loading, the process group): first
    thing in such a rank, or ahead of it in a warm process (`launcher.warm_ranks`)."""
    import longctx_cli.eval.checkpoint_loading  # noqa: F401
    import longctx_cli.runtime.distributed  # noqa: F401
    import longctx_cli.runtime.model  # noqa: F401


def run_eval(
    config_path: Path,
    checkpoint: Path,
    compare: Path | None,
    nproc_per_node: int | None,
    overrides: list[str] | None = None,
    early: EarlyTorchrun | None = None,
) -> int:
    """Entry of `longctx eval`; returns the process exit code. `overrides`: `--key value`
    config overrides, passed on to every rank; `early`: torchrun's agent, started while this
    launcher checks the run (see `EarlyTorchrun`)."""
    from longctx_cli.launcher.host_memory import fix_mmap_threshold
    from longctx_cli.launcher.launch import in_torchrun, launch_torchrun, rank_errors
    from longctx_cli.preflight import check_run

    overrides = list(overrides or [])
    config = load_config(config_path, overrides)
    if in_torchrun():
        import_rank_modules()
        with rank_errors(alike_on_every_rank=True):
            config, plan = check_run(config, "eval", overrides=overrides)
        fix_mmap_threshold(config.memory.host_mmap_threshold_mib)  # before the model and data
        from longctx_cli.runtime.distributed import process_group_released

        with rank_errors(), process_group_released():
            evaluate(config, plan, checkpoint, compare)
        return 0

    for path in (checkpoint, compare):
        if path is not None:
            checkpoint_kind(path)
            check_intact(path)  # a damaged folder fails here, once, before any rank starts
    # Forward only: the SP degree is the machine's (one SP group over the ranks by default).
    config, plan = check_run(config, "eval", nproc_per_node, overrides=overrides)
    from longctx_cli.data.prepare import prepare

    tokenizer = eval_tokenizer(config)
    held_out = has_held_out(config) and prepare(config, tokenizer).eval is not None
    specs = eval_specs(config, tokenizer, held_out)
    if "position_loss" in config.eval.eval_tasks and not specs.positions:
        print(skipped_positions(config), file=sys.stderr, flush=True)
    return launch_torchrun(_launch_args(config_path, checkpoint, compare, overrides),
                           plan.world_size, plan.world_size, early=early)


def evaluate(config: Config, plan: Plan, checkpoint: Path, compare: Path | None) -> None:
    """Inside torchrun, on every rank: evaluate the checkpoint(s) and write the results."""
    import torch.distributed as dist
    from rich.console import Console

    from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
    from longctx_cli.eval import report
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.distributed import init_distributed, load_rows

    device = init_distributed(config)
    state = build_parallel_state(plan.layout, device)
    rank = dist.get_rank()
    tokenizer = eval_tokenizer(config)
    pad_id = tokenizer_pad_id(tokenizer)
    rows = load_rows(config, tokenizer)[1] if has_held_out(config) else None
    specs = eval_specs(config, tokenizer, rows is not None)
    paths = [checkpoint] + ([compare] if compare is not None else [])
    results = [
        evaluate_model(config, path, label, specs, tokenizer, rows, state, pad_id, rank == 0)
        for path, label in zip(paths, report.model_labels(paths), strict=True)
    ]
    if rank == 0:
        console = Console()
        for table in report.tables(results):
            console.print(table)
        output_dir = Path(config.output.output_dir)
        for line in report.write_all(results, config.data.sequence_len, output_dir / "eval",
                                     output_dir / "metrics.jsonl"):
            # markup=False: rich would eat "[plots]"-like brackets in paths and hints.
            console.print(line, highlight=False, markup=False)
    dist.barrier()
    dist.destroy_process_group()


def evaluate_model(
    config: Config,
    path: Path,
    label: str,
    specs: EvalSpecs,
    tokenizer: PreTrainedTokenizerBase,
    rows: Dataset | None,
    state: ParallelState,
    pad_id: int,
    show_progress: bool,
) -> ModelResult:
    """Load one checkpoint and run the chosen evaluations on it (collective)."""
    from longctx_cli.eval.checkpoint_loading import load_for_eval
    from longctx_cli.eval.passkey_grid import run_passkey_grid
    from longctx_cli.eval.position_loss import position_loss
    from longctx_cli.eval.report import ModelResult
    from longctx_cli.eval.ruler_eval import run_ruler
    from longctx_cli.runtime.model import decoder_and_head

    model = load_for_eval(config, path).to(state.device)
    decoder, lm_head = decoder_and_head(model, config.trains_images)
    grid = positions = ruler = None
    if specs.grid is not None:
        grid = run_passkey_grid(decoder, lm_head, tokenizer, specs.grid, state, pad_id,
                                show_progress, label)
    if specs.positions:
        positions = position_loss(
            decoder, lm_head, rows, config.data.sequence_len, config.eval.eval_position_buckets,
            state,
            pad_id, config.memory.loss_chunk_size, show_progress, label,
        )
    if specs.ruler is not None:
        ruler = run_ruler(decoder, lm_head, tokenizer, specs.ruler, state, pad_id,
                          show_progress, label)
    return ModelResult(label, str(path.resolve()), grid, positions, ruler)

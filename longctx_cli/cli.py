"""The `longctx` command line: parse arguments, call one function, print its result.

Everything heavy (transformers, the data pipeline, the trainer) is imported inside the
command that needs it, so `longctx --help` answers at once.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from longctx_cli import __version__
from longctx_cli.errors import UserError, print_error, print_interrupted

F = TypeVar("F", bound=Callable[..., Any])


class _FlagsWithoutValues:
    """Show a flag (`--overwrite`, `--help`) bare in help tables: Typer's rich help prints
    a `<bool>` beside it, as though it took a value."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""  # an empty metavar is what the help table prints
        return params


class _Group(_FlagsWithoutValues, typer.core.TyperGroup):
    pass


class _Command(_FlagsWithoutValues, typer.core.TyperCommand):
    pass


app = typer.Typer(
    name="longctx",
    cls=_Group,
    help="Fine-tune Hugging Face causal LMs on very long sequences with sequence "
    "parallelism, from one YAML config.\n\n"
    "Start with [bold]validate[/] to see the resolved plan and memory estimate, then "
    "[bold]preprocess[/], [bold]train[/] and [bold]eval[/].",
    # Nothing under docs/ ships in the wheel: point at what an installed longctx has.
    epilog="Example: [bold]longctx validate examples/tiny_passkey.yaml --nproc-per-node 2[/]"
    "\n\n"
    "Each command: [bold]longctx COMMAND --help[/]. Every config key: "
    "[bold]python -m longctx_cli.config.docs[/].",
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ConfigArg = Annotated[
    Path,
    typer.Argument(
        metavar="CONFIG",
        help="YAML config file (its keys: `python -m longctx_cli.config.docs`).",
        show_default=False,
    ),
]
NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc-per-node",
        min=1,
        help="Ranks (processes) per node. Default: torchrun's WORLD_SIZE, else `world_size` "
        "in the config, else 1.",
        show_default=False,
    ),
]
# eval and generate start one SP group of the training run's size when nothing else says
# how many ranks (preflight.forward_only_plan).
ForwardNprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc-per-node",
        min=1,
        help="Ranks (processes) per node. Default: torchrun's WORLD_SIZE, else `world_size` "
        "in the config, else its `sequence_parallel_degree`.",
        show_default=False,
    ),
]
# Any top-level config key can follow the config file as `--key value` (Axolotl's way):
# Click leaves unknown options in ctx.args, and load_config validates them like the file.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def no_default_shown(flag: str, help: str) -> Any:
    """An option whose help shows no default (`--checkpoint`, `--output`, `--prompt`, ...)."""
    return typer.Option(flag, help=help, show_default=False)


def overrides_help(example: str) -> str:
    """The help paragraph on config overrides, with an example that suits the command."""
    return ("\n\nAny top-level config key can be overridden after CONFIG, e.g. "
            f"[bold]{example}[/] (dashes or underscores).")


NnodesOpt = Annotated[
    int | None,
    typer.Option("--nnodes", min=1, help="Number of nodes (default 1).", show_default=False),
]


def command_options(ctx: typer.Context) -> list[str]:
    """The long options of the running command (`--nproc-per-node`, ...)."""
    return [o for param in ctx.command.params for o in param.opts if o.startswith("--")]


def _interrupted() -> None:
    print_interrupted()
    sys.exit(130)


def _user_errors(command: F) -> F:
    """Print a UserError as one paragraph and exit 2 (also under Typer's test runner);
    Ctrl-C exits 130 with one line instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as e:
            print_error(e)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _interrupted()

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"longctx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Sequence-parallel long-context fine-tuning."""


@app.command(
    cls=_Command,
    help="Check a config against the world size and the model, and print the resolved plan."
    "\n\nThe plan shows the data x sequence parallel layout, the ring and why, tokens per "
    "rank, the attention kernel and a rough per-rank memory estimate, judged against the "
    "target's memory per rank when one is known. Nothing is trained and "
    "no weights are downloaded: the model's config is read (a few well-known models work "
    "offline from a built-in table), the first records of local data files are read as "
    "preprocess reads them, "
    "output_dir must be writable and LoRA targets must exist in the model. Then the fidelity "
    "probe compares the loss and gradients of a tiny random model of the same family under "
    "longctx with the model's own forward (seconds)."
    + overrides_help("--sequence-len 131072 --sequence-parallel-degree 8"),
    context_settings=OVERRIDES,
    epilog="Examples:\n\n"
    "  longctx validate examples/tiny_passkey.yaml --nproc-per-node 2\n\n"
    "  longctx validate examples/qwen2.5-7b-128k-2nodes.yaml --nproc-per-node 8 --nnodes 2\n\n"
    "Exit status: 0 valid, 2 invalid (the message names the key and how to fix it).",
)
@_user_errors
def validate(
    ctx: typer.Context,
    config: ConfigArg,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
    memory_per_rank: Annotated[
        str | None,
        typer.Option(
            "--memory-per-rank",
            help="The target's memory per rank (e.g. 80GiB, 24GB): the plan must fit in it, "
            "and the smallest sequence_parallel_degree that fits is reported. Default: "
            "`memory_per_rank` in the config, else this machine's GPUs.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the plan, or a UserError naming the key to fix."""
    from longctx_cli.config import load_config
    from longctx_cli.config.fit import fit_report, judge_fit, parse_memory_size, target_memory
    from longctx_cli.preflight import check_run

    if memory_per_rank is not None:
        parse_memory_size(memory_per_rank)  # a bad size is refused before anything is read
    cfg = load_config(config, ctx.args, command_options(ctx))
    # The checks every entry point and every rank runs: the plan, then the world around the
    # config (data files, output_dir, LoRA targets).
    cfg, plan = check_run(cfg, "validate", nproc_per_node, nnodes, overrides=list(ctx.args),
                          assume_gpu=True)
    console = Console()
    console.print(plan.to_table())
    from longctx_cli.data.check import check_data

    for line in check_data(cfg):  # the records, read as preprocess reads them
        console.print(f"data: {line}", markup=False, highlight=False)
    target = target_memory(cfg, memory_per_rank)
    if memory_per_rank is not None and target is not None:
        console.print("\n".join(fit_report(cfg, plan, target.bytes)), markup=False)
    fit = judge_fit(cfg, plan, target) if target is not None else None
    if fit is not None:
        console.print(fit, markup=False, highlight=False)
    mixing = _token_mixing(cfg, plan)
    if mixing:
        console.print(f"token mixing: {mixing}", markup=False, highlight=False)
    # The plan is printed first: the probe needs torch and transformers, seconds to import.
    console.print(f"fidelity probe: {_fidelity(cfg, plan.model, console)}", markup=False,
                  highlight=False)
    console.print("[green]valid[/]")
    if fit is None:  # the last line says what "valid" did not cover
        console.print("fit not judged: no target memory per rank (give `--memory-per-rank "
                      "80GiB` or `memory_per_rank` in the config, or run on the GPUs)",
                      markup=False, highlight=False)


def _token_mixing(cfg: Any, plan: Any) -> str | None:
    """The hybrid model's layers that mix tokens outside attention, and what they cost."""
    from longctx_cli.families import family

    if not family(plan.model.model_type).mixes_tokens:
        return None  # no torch import: a plain model's plan stays instant
    from longctx_cli.config.units import DTYPE_BYTES
    from longctx_cli.parallel.token_mixing import describe
    from longctx_cli.preflight import meta_model

    model = meta_model(cfg)
    if model is None:
        return None
    return describe(model, plan.layout.sp, plan.layout.sharding, cfg.data.sequence_len,
                    plan.model.hidden_size, DTYPE_BYTES[cfg.model.dtype])


def _fidelity(cfg: Any, shape: Any, console: Console) -> str:
    """The fidelity probe's verdict (raises UserError when it refuses)."""
    if not cfg.run.fidelity_probe:
        return "skipped (`fidelity_probe: false`)"
    with console.status("fidelity probe: comparing a tiny model of this family with the "
                        "model's own forward ..."):
        hf_config = shape.transformers_config()
        if hf_config is None:
            return "not run: the model's config is not at hand"
        from longctx_cli.checks.fidelity import run_probe

        return run_probe(hf_config, cfg.model.trust_remote_code, cfg.trains_images,
                         cfg.model.llama4_linearized_experts).summary()


@app.command(
    cls=_Command,
    help="Tokenize and pack the datasets once, and cache them for `train`.\n\n"
    "The cache goes to `dataset_prepared_path` (default `<output_dir>/prepared`) and is "
    "reused by `train` while the data, tokenizer and packing options are unchanged."
    + overrides_help("--sequence-len 8192 --dataset-prepared-path /scratch/prepared"),
    context_settings=OVERRIDES,
    epilog="Examples:\n\n"
    "  longctx preprocess examples/tiny_passkey.yaml\n\n"
    "  longctx preprocess my.yaml --force   # rebuild even if the cache matches",
)
@_user_errors
def preprocess(
    ctx: typer.Context,
    config: ConfigArg,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild the cache even when its fingerprint matches.")
    ] = False,
) -> None:
    """Build (or reuse) the prepared dataset and print its report."""
    from longctx_cli.config import load_config
    from longctx_cli.data.prepare import prepare

    cfg = load_config(config, ctx.args, command_options(ctx))
    prepared = prepare(cfg, force=force)
    console = Console()
    console.print(prepared.report.render())
    console.print(f"cache: {getattr(prepared, 'path', None) or cfg.prepared_path}")


@app.command(
    cls=_Command,
    help="Train with torchrun: one process per rank, Hugging Face checkpoints in output_dir."
    "\n\nWrites output_dir/metrics.jsonl (one line per optimizer step), resumable "
    "output_dir/checkpoint-<step>/ folders and the final model in output_dir/final/. For "
    "several nodes, run the same command on every node with its own --node-rank."
    + overrides_help("--learning-rate 2e-5 --max-steps 100"),
    context_settings=OVERRIDES,
    epilog="Examples:\n\n"
    "  longctx train examples/tiny_passkey.yaml --nproc-per-node 2\n\n"
    "  longctx train my.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 "
    "--rdzv-endpoint node0:29500   # run on every node with its --node-rank",
)
@_user_errors
def train(
    ctx: typer.Context,
    config: ConfigArg,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: Annotated[
        int, typer.Option("--node-rank", min=0, help="This node's rank (0 .. nnodes-1).")
    ] = 0,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="Rendezvous address shared by all nodes (multi-node).",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Start afresh even if output_dir has a previous run."),
    ] = False,
) -> None:
    """Hand over to the launcher; its return value is the exit status."""
    from longctx_cli.launcher.launch import in_torchrun
    from longctx_cli.train.run import run_train

    status = run_train(
        config_path=config,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        overwrite=overwrite,
        overrides=list(ctx.args),
        early=ctx.obj,  # main()'s EarlyTorchrun, if it started one
    )
    if status == 0 and node_rank == 0 and not in_torchrun():  # the launcher, once
        from longctx_cli.config import load_config

        settings = load_config(config, list(ctx.args))
        if settings.output.merge_lora and settings.lora.adapter is not None:  # else no merge
            from longctx_cli.eval.merge import merge_after_training

            merge_after_training(settings)
    raise typer.Exit(status)


@app.command(
    name="eval",
    cls=_Command,
    help="Long-context evaluation: passkey retrieval grid, loss by position, RULER's "
    "synthetic tasks.\n\n"
    "RULER's tasks run when the config's eval_tasks names them (ruler for all of them, or "
    "one such as niah_single_1). Optionally evaluates a second checkpoint (--compare) the "
    "same way, side by side. The "
    "SP degree is the machine's: by default one SP group over the ranks started (the "
    "scores do not depend on it)." + overrides_help("--eval-samples-per-cell 20"),
    context_settings=OVERRIDES,
    epilog="Examples:\n\n"
    "  longctx eval examples/tiny_passkey.yaml --checkpoint outputs/tiny_passkey/final\n\n"
    "  longctx eval my.yaml --checkpoint out/final --compare base_model_dir",
)
@_user_errors
def eval_(
    ctx: typer.Context,
    config: ConfigArg,
    checkpoint: Annotated[
        Path,
        no_default_shown("--checkpoint", "Checkpoint folder to evaluate."),
    ],
    compare: Annotated[
        Path | None,
        no_default_shown("--compare", "A second checkpoint to evaluate side by side."),
    ] = None,
    nproc_per_node: ForwardNprocOpt = None,
) -> None:
    """Hand over to the evaluator; its return value is the exit status."""
    from longctx_cli.eval.run import run_eval

    raise typer.Exit(
        run_eval(
            config_path=config,
            checkpoint=checkpoint,
            compare=compare,
            nproc_per_node=nproc_per_node,
            overrides=list(ctx.args),
            early=ctx.obj,  # main()'s EarlyTorchrun, if it started one
        )
    )


@app.command(
    cls=_Command,
    help="Greedy continuation of a prompt, computed sequence-parallel (exact for any number "
    "of ranks).\n\nThe continuation alone goes to stdout; the prompt's length and progress "
    "to stderr. The SP degree is the machine's: by default one SP group over the ranks "
    "started, whatever the run trained with." + overrides_help("--sequence-len 32768"),
    context_settings=OVERRIDES,
    epilog="Examples:\n\n"
    "  longctx generate my.yaml --checkpoint outputs/run/final --prompt-file prompt.txt\n\n"
    "  longctx generate my.yaml --checkpoint outputs/run/final --prompt 'Once upon'\n\n"
    "  cat prompt.txt | longctx generate my.yaml --checkpoint outputs/run/merged "
    "--nproc-per-node 4",
)
@_user_errors
def generate(
    ctx: typer.Context,
    config: ConfigArg,
    checkpoint: Annotated[
        Path,
        no_default_shown("--checkpoint", "final/, checkpoint-<step>/ or merged/ folder."),
    ],
    prompt_file: Annotated[
        Path | None,
        no_default_shown("--prompt-file", "UTF-8 text file with the prompt (default: stdin)."),
    ] = None,
    prompt: Annotated[
        str | None,
        no_default_shown("--prompt", "The prompt itself (instead of --prompt-file or stdin)."),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Most tokens to generate.")
    ] = 64,
    nproc_per_node: ForwardNprocOpt = None,
) -> None:
    """Hand over to the generator; its return value is the exit status."""
    from longctx_cli.eval.generate import run_generate

    raise typer.Exit(run_generate(config, checkpoint, prompt_file, max_new_tokens,
                                  nproc_per_node, list(ctx.args),
                                  early=ctx.obj,  # main()'s EarlyTorchrun, if it started one
                                  prompt=prompt))


@app.command(
    name="merge-lora",
    cls=_Command,
    help="Merge a LoRA/QLoRA adapter into its base: a plain Hugging Face model folder."
    + overrides_help("--dtype float16"),
    context_settings=OVERRIDES,
    epilog="Example:\n\n"
    "  longctx merge-lora my.yaml --checkpoint outputs/run/final --output outputs/run/merged",
)
@_user_errors
def merge_lora(
    ctx: typer.Context,
    config: ConfigArg,
    checkpoint: Annotated[
        Path,
        no_default_shown("--checkpoint", "The run's final/ folder (an adapter)."),
    ],
    output: Annotated[
        Path | None,
        no_default_shown("--output", "Where to write it (default: <output_dir>/merged)."),
    ] = None,
) -> None:
    """Write base + adapter, in the config's dtype, with tokenizer and generation config."""
    from longctx_cli.eval.merge import run_merge

    raise typer.Exit(run_merge(config, checkpoint, output, list(ctx.args)))


def main() -> None:
    """Console entry point: run the app; a UserError is one paragraph on stderr, exit 2."""
    from longctx_cli.launcher.launch import EarlyTorchrun
    from longctx_cli.launcher.startup import quiet_library_loggers

    quiet_library_loggers()
    # `longctx train`, `eval` and `generate` start torchrun's agent first: its torch import
    # overlaps the launcher's checks.
    early = EarlyTorchrun.for_command_line(sys.argv[1:])
    try:
        app(obj=early)  # standalone mode: Typer prints usage errors and exits with their status
    except UserError as e:  # raised outside a command body, e.g. while parsing
        print_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _interrupted()
    finally:
        if early is not None:
            early.cancel()  # the launcher stopped before it handed the job over


if __name__ == "__main__":
    main()

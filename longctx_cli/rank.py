"""The entry of the ranks longctx's own launcher starts: `python -m longctx_cli.rank train
CONFIG [--key value ...]`, `eval CONFIG --checkpoint DIR [--compare DIR] [--key value ...]`
or `generate CONFIG --checkpoint DIR --prompt-file FILE --max-new-tokens N [--key value ...]`:
arguments a launcher composed after it had parsed and checked the command line.

It calls the same functions as `longctx train|eval|generate` without the command-line
layer: Typer builds and parses its commands in about 0.25 s of every rank's start on a small
CPU, for arguments already parsed once. A user's own torchrun or srun runs `-m longctx_cli`,
the documented command, which reaches the same functions.
"""

from __future__ import annotations

import sys
from pathlib import Path

from longctx_cli.errors import UserError, print_error, print_interrupted
from longctx_cli.launcher.startup import process_created_at, quiet_library_loggers
from longctx_cli.launcher.warm_ranks import WARM_FLAG, hand_over, serve


def leading_options(args: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """The `--name value` pairs at the front of `args` whose name is one of `names` (where
    the launchers put their own options), and the config overrides after them."""
    options: dict[str, str] = {}
    while len(args) >= 2 and args[0] in names:
        options[args[0]], args = args[1], args[2:]
    return options, args


def run(argv: list[str]) -> int:
    """Run one rank of `train`, `eval` or `generate`; its exit status."""
    command, config, *rest = argv
    if command == "train":
        from longctx_cli.train.run import run_train

        return run_train(Path(config), None, None, 0, None, False, rest)
    if command == "eval":
        from longctx_cli.eval.run import run_eval

        given, overrides = leading_options(rest, ("--checkpoint", "--compare"))
        compare = given.get("--compare")
        return run_eval(Path(config), Path(given["--checkpoint"]),
                        Path(compare) if compare is not None else None, None, overrides)
    if command == "generate":
        from longctx_cli.eval.generate import run_generate

        given, overrides = leading_options(
            rest, ("--checkpoint", "--prompt-file", "--max-new-tokens"))
        return run_generate(Path(config), Path(given["--checkpoint"]),
                            Path(given["--prompt-file"]), int(given["--max-new-tokens"]), None,
                            overrides)
    raise ValueError(f"not a command ranks run: {command!r}")


def warm_up(argv: list[str]) -> None:
    """Import what `run(argv)` will import (a warm process, ahead of its rank)."""
    quiet_library_loggers()  # before the imports: they are what logs
    command, config, *rest = argv
    if command == "train":
        from longctx_cli.train.run import import_rank_modules, load_config

        import_rank_modules(load_config(Path(config), rest))
    elif command in ("eval", "generate"):
        import longctx_cli.eval.generate  # noqa: F401
        from longctx_cli.eval.run import import_rank_modules

        import_rank_modules()


def main(argv: list[str]) -> int:
    """As `longctx`'s `main` for these commands: a UserError is one paragraph and status 2,
    a Ctrl-C one line and 130."""
    quiet_library_loggers()
    try:
        return run(argv)
    except UserError as e:
        print_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print_interrupted()
        return 130


def entry(argv: list[str]) -> int:
    """`python -m longctx_cli.rank`: a warm process (`WARM_FLAG ...`, started by the
    launcher), or a rank torchrun started, which its warm process runs when there is one."""
    if argv[:1] == [WARM_FLAG]:
        return serve(argv[1:], warm_up, main)
    status = hand_over(argv, process_created_at())
    return main(argv) if status is None else status


if __name__ == "__main__":
    sys.exit(entry(sys.argv[1:]))

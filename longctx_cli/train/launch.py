"""`longctx train`: validate, then run torchrun with ourselves as the entry point.

Outside a torchrun environment the command checks the config and plan, makes sure the
output directory may be written, builds the data cache once, and starts
`python -m torch.distributed.run ... -m longctx_cli train CONFIG`. Inside one (RANK and
WORLD_SIZE set: our own launch, a user's torchrun or a SLURM script) it trains directly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from longctx_cli.config import Config, load_config
from longctx_cli.config.plan import build_plan, read_model_config, resolve_world_size
from longctx_cli.errors import UserError

# Things a finished or running job leaves in output_dir; their presence means "another run".
RUN_ARTIFACTS = ("metrics.jsonl", "final")
# Set for the ranks we launch: they hand a UserError to us instead of each printing it.
LAUNCHED_ENV = "LONGCTX_LAUNCHED"
# A full, over-quota or read-only disk: the user's to fix, never a reason for a traceback.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS})


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def previous_run_artifacts(output_dir: Path) -> list[Path]:
    if not output_dir.is_dir():
        return []
    found = [output_dir / name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    found += sorted(output_dir.glob("checkpoint-*"))
    return found


def check_output_dir(config: Config, overwrite: bool) -> None:
    """Refuse to train over another run's results unless told to resume or overwrite."""
    output_dir = Path(config.output_dir)
    found = previous_run_artifacts(output_dir)
    if not found or config.resume_from_checkpoint is not None:
        return
    if overwrite:
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
    raise UserError(
        f"output_dir {str(output_dir)!r} already holds another run's results ({names}).",
        where="output_dir",
        fix="set `resume_from_checkpoint: auto` to continue it, pass --overwrite to replace it, "
        "or choose a new `output_dir`.",
    )


def torchrun_args(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
) -> list[str]:
    if nnodes == 1 and rdzv_endpoint is None:
        return ["--standalone", f"--nproc-per-node={nproc_per_node}"]
    if rdzv_endpoint is None:
        raise UserError(
            f"--nnodes {nnodes} needs a rendezvous address.",
            where="--rdzv-endpoint",
            fix="pass --rdzv-endpoint HOST:PORT (the same on every node) and --node-rank.",
        )
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
    ]


def run_train(
    config_path: Path,
    nproc_per_node: int | None,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    overwrite: bool,
    overrides: list[str] | None = None,
) -> int:
    """Entry of `longctx train`; returns the process exit code. `overrides` are `--key value`
    arguments after the config; every rank receives them too."""
    overrides = list(overrides or [])
    config = load_config(config_path, overrides)
    if in_torchrun():
        from longctx_cli.train.loop import train

        with rank_errors():
            train(config)
        return 0

    world_size = resolve_world_size(config, nproc_per_node, nnodes)
    build_plan(config, world_size, read_model_config(config))
    from longctx_cli.preflight import preflight

    preflight(config)
    check_output_dir(config, overwrite)
    if node_rank == 0 and not config.pretraining_dataset:  # streamed data has no cache
        # Build (or reuse) the data cache once here, with progress bars, before any rank starts.
        from longctx_cli.data.prepare import prepare

        prepare(config)
    return launch_torchrun(
        ["train", str(config_path), *overrides],
        world_size, nproc_per_node, nnodes, node_rank, rdzv_endpoint,
    )


def launch_torchrun(
    command_args: list[str],
    world_size: int,
    nproc_per_node: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> int:
    """Run torchrun (`torch.distributed.run`, through `torchrun_main`) with
    `-m longctx_cli <command_args>` as the entry point; its exit code."""
    per_node = nproc_per_node or max(1, world_size // nnodes)
    command = [
        sys.executable,
        "-m",
        "longctx_cli.train.launch",  # torchrun itself, with a one-line summary on failure
        *torchrun_args(per_node, nnodes, node_rank, rdzv_endpoint),
        "-m",
        "longctx_cli",
        *command_args,
    ]
    env = dict(os.environ)
    env[LAUNCHED_ENV] = "1"
    # One compute thread per rank unless the user chose otherwise: ranks share the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_node)))
    try:
        # An argument list, never a shell: paths from the user are passed verbatim.
        return subprocess.run(command, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


@contextlib.contextmanager
def rank_errors() -> Iterator[None]:
    """Inside a rank: a UserError (or a full / read-only disk) ends this rank with status 2.

    Under our launcher the message goes to torchrun's per-rank error file
    (TORCHELASTIC_ERROR_FILE) and is not printed: the launcher prints the first one once,
    with its rank, instead of once per rank. Under a user's own torchrun it is raised as usual.
    """
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        error = UserError(
            f"could not write {e.filename or 'a file'}: {e.strerror} (errno {e.errno}).",
            where="output_dir",
            fix="free space on that disk (or choose an output_dir with room that can be "
            "written), then run the same command with `resume_from_checkpoint: auto`.",
        )
        _hand_over(error)
        raise error from None
    except UserError as e:
        _hand_over(e)
        raise


def _hand_over(error: UserError) -> None:
    """Write `error` to torchrun's error file and exit 2, when the launcher will print it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(LAUNCHED_ENV) != "1" or not path:
        return
    now = time.time()
    record = {"message": str(error), "timestamp": int(now),
              "longctx": {"user_error": True, "time": now}}
    Path(path).write_text(json.dumps(record))
    sys.exit(UserError.exit_code)


def _user_error(failure) -> tuple[str, float] | None:
    """(message, time) of a rank that handed over a UserError, else None."""
    data = getattr(failure, "error_file_data", None) or {}
    extra = data.get("longctx") if isinstance(data, dict) else None
    if isinstance(extra, dict) and extra.get("user_error"):
        return str(data.get("message", "")), float(extra.get("time", failure.timestamp))
    return None


def describe_failure(failures: dict, command: str = "train") -> str:
    """One line naming the rank that failed first and how, from torchrun's `ProcessFailure`s.

    A rank that stopped on a UserError is the cause when there is one (the earliest, if
    several ranks raised one): its message is shown once, with its rank.
    """
    reported = {r: e for r, f in failures.items() if (e := _user_error(f)) is not None}
    if reported:
        rank = min(reported, key=lambda r: (reported[r][1], r))
        return f"rank {rank}: {reported[rank][0]}"
    # torchrun stops the surviving ranks with SIGTERM: those deaths are not the cause.
    causes = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    rank = min(causes, key=lambda r: (causes[r].timestamp, r))
    failure = causes[rank]
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    if failure.exitcode == UserError.exit_code:
        return f"{command} stopped: {who} reported the error above; torchrun stopped the others."
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    else:
        how = f"exited with status {failure.exitcode}"
    message = f"{command} failed: {who} {how}; torchrun stopped the other ranks."
    if command == "train":
        message += (
            " To continue from the last complete checkpoint, set "
            "`resume_from_checkpoint: auto` and run the same command again."
        )
    return message


def failure_exit_code(failures: dict) -> int:
    """2 when a rank stopped on a UserError (bad config or data, NaN loss), else 1."""
    codes = {f.exitcode for f in failures.values()}
    return UserError.exit_code if UserError.exit_code in codes else 1


def torchrun_main(argv: list[str]) -> int:
    """Run torchrun with `argv` in this process; its exit status.

    torchrun reports a failed job as a traceback of its own with the dead rank deep inside;
    this ends such a job with one line that names the rank instead, and keeps the CLI's exit
    status 2 when a rank stopped on a UserError.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except ChildFailedError as e:
        # The longctx command the ranks run: the word after `-m longctx_cli`.
        command = argv[argv.index("longctx_cli") + 1] if "longctx_cli" in argv[:-1] else "job"
        print(f"error: {describe_failure(e.failures, command)}", file=sys.stderr, flush=True)
        return failure_exit_code(e.failures)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))

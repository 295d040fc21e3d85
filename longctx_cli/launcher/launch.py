"""The torchrun launch train and eval share: run `python -m torch.distributed.run ... -m
longctx_cli.rank COMMAND CONFIG` with this module as torchrun's wrapper (one-line failure
summaries), and inside a rank turn a UserError into a clean exit. Inside torchrun (RANK and
WORLD_SIZE set: our own launch, a user's torchrun or a SLURM script) a command runs directly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from longctx_cli.errors import PREEMPTED_EXIT, UserError
from longctx_cli.launcher.warm_ranks import WarmRanks

# Set for the ranks we launch: they hand a UserError to us instead of each printing it.
LAUNCHED_ENV = "LONGCTX_LAUNCHED"
# torchrun's agent handles these by default (stopping its workers); preemption adds more.
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# What each rank runs (`-m RANK_MODULE COMMAND ...`): the command without the CLI layer.
RANK_MODULE = "longctx_cli.rank"
# This module, run as torchrun with a one-line failure summary (`torchrun_main`) ...
LAUNCH_MODULE = "longctx_cli.launcher.launch"
# ... or as `python -m longctx_cli.launcher.launch AWAIT_FLAG FD STDERR_FD`: an `EarlyTorchrun`.
AWAIT_FLAG = "--await-command-on-fd"
# Where the torchrun wrapper writes the one-line reason a job failed (read by the supervisor).
FAILURE_FILE_ENV = "LONGCTX_FAILURE_FILE"
# A full, over-quota or read-only disk: the user's to fix, never a reason for a traceback.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS})


# How long a rank other than 0 waits before it exits on an error every rank raised alike
# (a refused config under a user's torchrun or srun): torchrun stops the other ranks as soon
# as one exits, and rank 0 must have printed the paragraph by then.
AGREED_ERROR_WAIT_S = 3.0


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_by_longctx() -> bool:
    """This rank was started by longctx's own launcher, which checked the world around the
    config (data files, output_dir) before it started any rank."""
    return os.environ.get(LAUNCHED_ENV) == "1"


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


@dataclass(frozen=True)
class TorchrunJob:
    """A torchrun launch: its command line and environment, the ranks it starts on this node
    and what each of them runs after `-m longctx_cli.rank`."""

    command: list[str]
    env: dict[str, str]
    per_node: int
    rank_args: list[str]

    def with_env(self, values: dict[str, str]) -> TorchrunJob:
        return replace(self, env={**self.env, **values})


def torchrun_command(
    command_args: list[str],
    world_size: int,
    nproc_per_node: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    signals: tuple[str, ...] = (),
    shutdown_timeout: int | None = None,
) -> TorchrunJob:
    """The torchrun job (through `torchrun_main`) running `-m longctx_cli.rank
    <command_args>` (`longctx <command_args>` without its command-line layer). `signals`:
    passed on to every rank (preemption); `shutdown_timeout`: how long torchrun waits for the
    ranks after such a signal."""
    per_node = nproc_per_node or max(1, world_size // nnodes)
    handled = ",".join(dict.fromkeys([*TORCHRUN_SIGNALS, *signals]))
    command = [
        sys.executable,
        "-m",
        LAUNCH_MODULE,  # torchrun itself, with a one-line summary on failure
        *torchrun_args(per_node, nnodes, node_rank, rdzv_endpoint),
        f"--signals-to-handle={handled}",
        *([f"--shutdown-timeout={shutdown_timeout}"] if shutdown_timeout is not None else []),
        "-m",
        RANK_MODULE,
        *command_args,
    ]
    env = dict(os.environ)
    env[LAUNCHED_ENV] = "1"
    threads, warning = rank_threads(env.get("OMP_NUM_THREADS"), per_node, os.cpu_count() or 1)
    env["OMP_NUM_THREADS"] = str(threads)
    if warning:
        print(warning, file=sys.stderr)
    return TorchrunJob(command, env, per_node, list(command_args))


def launch_torchrun(
    command_args: list[str],
    world_size: int,
    nproc_per_node: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    early: EarlyTorchrun | None = None,
) -> int:
    """Run torchrun with `-m longctx_cli.rank <command_args>` as the entry point (in `early`'s
    waiting process, when given); its exit code."""
    job = torchrun_command(command_args, world_size, nproc_per_node, nnodes, node_rank,
                           rdzv_endpoint)
    with started_torchrun(job, early, warm=True) as proc:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the ranks got the terminal's Ctrl-C too
            proc.kill()
            proc.wait()
            return 130


@contextlib.contextmanager
def started_torchrun(job: TorchrunJob, early: EarlyTorchrun | None = None,
                     warm: bool = False) -> Iterator[subprocess.Popen]:
    """Start `job` (in `early`'s waiting process while it waits, else anew); with `warm`,
    beside a `WarmRanks` process per local rank, ended or waited for on exit."""
    warm_ranks = None
    env = job.env
    if warm:
        warm_ranks = WarmRanks(RANK_MODULE, job.rank_args, job.per_node, env)
        env = {**env, **warm_ranks.environment()}
    try:
        if early is not None and early.waiting:
            yield early.start(job.command, env)
        else:
            # An argument list, never a shell: paths from the user are passed verbatim.
            yield subprocess.Popen(job.command, env=env)
    finally:
        if warm_ranks is not None:
            warm_ranks.close()


class EarlyTorchrun:
    """torchrun's agent, started before the launcher has planned the job. Most of torchrun's
    start-up is its import of torch (1.5-2 s on a small CPU); started first, that import
    overlaps the launcher's own imports and checks. The process waits for its command line
    and environment on a pipe: `start` hands them over, `cancel` ends it unused."""

    def __init__(self) -> None:
        # Until the hand-over its stderr is /dev/null: a Ctrl-C in its first milliseconds
        # (before it can catch one) must not print a traceback; ours goes along for after.
        read_fd, self._write_fd = os.pipe()
        stderr_fd = os.dup(sys.stderr.fileno())
        try:
            self.process: subprocess.Popen = subprocess.Popen(
                [sys.executable, "-m", LAUNCH_MODULE, AWAIT_FLAG, str(read_fd), str(stderr_fd)],
                pass_fds=(read_fd, stderr_fd), stderr=subprocess.DEVNULL)
        finally:
            os.close(read_fd)
            os.close(stderr_fd)

    @classmethod
    def for_command_line(cls, argv: list[str]) -> EarlyTorchrun | None:
        """One for `longctx train|eval|generate ...` by hand (never inside a rank, never for
        --help)."""
        wanted = bool(argv) and argv[0] in ("train", "eval", "generate")
        if not wanted or in_torchrun() or {"-h", "--help"} & set(argv):
            return None
        return cls()

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Run `command` (a `TorchrunJob`'s) with `env` in the waiting process."""
        assert command[:3] == [sys.executable, "-m", LAUNCH_MODULE], command
        assert self._write_fd is not None, "the command was handed over already"
        with os.fdopen(self._write_fd, "w") as pipe:
            self._write_fd = None
            pipe.write(json.dumps({"argv": command[3:], "env": env}))
        return self.process

    @property
    def waiting(self) -> bool:
        return self._write_fd is not None

    def cancel(self) -> None:
        """End the process if no command was handed to it (the launcher stopped first)."""
        if self._write_fd is None:
            return
        os.close(self._write_fd)
        self._write_fd = None
        self.process.terminate()  # mid-import it would otherwise finish importing first
        self.process.wait()


def await_command(fd: int, stderr_fd: int) -> int:
    """The waiting side of `EarlyTorchrun`: import torchrun, then run the command line read
    from `fd` with its environment and `stderr_fd` as stderr; exit quietly when none comes."""
    try:
        import torch.distributed.run  # noqa: F401  the slow part, while the launcher plans

        with os.fdopen(fd) as pipe:
            handoff = pipe.read()
    except KeyboardInterrupt:  # Ctrl-C before the job began: the launcher reports it
        return 130
    if not handoff:
        return 0
    os.dup2(stderr_fd, sys.stderr.fileno())
    os.close(stderr_fd)
    job = json.loads(handoff)
    os.environ.clear()
    os.environ.update(job["env"])
    return torchrun_main(job["argv"])


def rank_threads(user_value: str | None, per_node: int, cpus: int) -> tuple[str, str | None]:
    """Compute threads per rank (OMP_NUM_THREADS) and a warning when they oversubscribe.

    Ranks share the node's cores: by default each gets cpus // per_node (at least 1). A value
    the user set is kept, but more threads than cores in all makes every rank wait on the
    others' threads (measured on the bundled example, 2 ranks x 2 threads on 2 cores: about a
    quarter of the 1-thread speed), so it is said once, before the ranks start.
    """
    if user_value is None or not user_value.strip():
        return str(max(1, cpus // per_node)), None
    try:
        wanted = int(user_value)
    except ValueError:
        return user_value, None  # not ours to judge; OpenMP reports a value it cannot read
    if wanted * per_node <= cpus:
        return user_value, None
    return user_value, (
        f"warning: OMP_NUM_THREADS={wanted} with {per_node} ranks on this node is "
        f"{wanted * per_node} compute threads on {cpus} cores; ranks will slow each other "
        f"down. Unset it (longctx then gives each rank {max(1, cpus // per_node)}) or set "
        f"OMP_NUM_THREADS={max(1, cpus // per_node)}."
    )


@contextlib.contextmanager
def rank_errors(alike_on_every_rank: bool = False) -> Iterator[None]:
    """Inside a rank: a UserError (or a full / read-only disk) ends this rank with status 2.

    Under our launcher the message goes to torchrun's per-rank error file
    (TORCHELASTIC_ERROR_FILE) and is not printed: the launcher prints the first one once,
    with its rank, instead of once per rank. Under a user's own torchrun or srun it is raised
    as usual (the CLI prints it as one paragraph), except that an error every rank raises
    alike (`alike_on_every_rank`: the checks of `preflight.check_run`) is printed by rank 0
    alone; the other ranks exit 2 without a word.
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
        if alike_on_every_rank and int(os.environ.get("RANK", "0")) != 0:
            time.sleep(AGREED_ERROR_WAIT_S)
            sys.exit(UserError.exit_code)
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
    several ranks raised one): its message is shown once, with its rank, the lowest of the
    ranks that raised the same message (ranks that read the same rows fail alike, in
    whichever order their clocks say).
    """
    reported = {r: e for r, f in failures.items() if (e := _user_error(f)) is not None}
    if reported:
        first = min(reported, key=lambda r: (reported[r][1], r))
        message = reported[first][0]
        rank = min(r for r, (text, _) in reported.items() if text == message)
        return f"rank {rank}: {message}"
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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # torchelastic logs a failed child ("failed (exitcode ...)") and its error-file copying
    # ("no error file defined for parent ...") before the exception we turn into one line
    # naming the rank: silenced at their source, so that line (and a rank's paragraph) is all
    # the user reads.
    for name in ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.multiprocessing.errors.error_handler"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        main(argv)
    except SignalException as e:  # its workers got the signal and the shutdown timeout
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if preempted(e.failures):
            return PREEMPTED_EXIT
        command = rank_command(argv)
        message = describe_failure(e.failures, command)
        print(f"error: {message}", file=sys.stderr, flush=True)
        if os.environ.get(FAILURE_FILE_ENV):
            Path(os.environ[FAILURE_FILE_ENV]).write_text(json.dumps({"message": message}))
        return failure_exit_code(e.failures)
    return 0


def rank_command(torchrun_argv: list[str]) -> str:
    """The longctx command the ranks run: the word after `-m longctx_cli.rank` (ours) or
    `-m longctx_cli` (a torchrun command line written by hand)."""
    for module in (RANK_MODULE, "longctx_cli"):
        if module in torchrun_argv[:-1]:
            return torchrun_argv[torchrun_argv.index(module) + 1]
    return "job"


def preempted(failures: dict) -> bool:
    """Every rank saved and exited 75 (torchrun may have stopped the last ones to leave)."""
    codes = {f.exitcode for f in failures.values()}
    return PREEMPTED_EXIT in codes and codes <= {PREEMPTED_EXIT, -signal.SIGTERM,
                                                  -signal.SIGKILL}


if __name__ == "__main__":
    if sys.argv[1:2] == [AWAIT_FLAG]:
        sys.exit(await_command(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(torchrun_main(sys.argv[1:]))

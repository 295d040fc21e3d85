"""Ranks that import while torchrun starts: `WarmRanks`.

A rank spends most of its start-up importing torch and transformers' model code (4-5 s on a
small CPU), and torchrun's agent starts it only once the agent has imported torch itself
(about 2 s). The launcher therefore starts one warm process per local rank beside torchrun:
each imports what the rank will run, then waits on a Unix socket. The rank torchrun starts
(`python -m longctx_cli.rank ...`) connects to its warm process first thing and hands over
what torchrun gave it: its environment, working directory and command line. The warm process
runs the rank from there and reports the exit status back; until then the rank torchrun
started passes on every signal torchrun sends it and exits with that status, so torchrun's
agent, its failure handling and its signals work as before.

Nothing is lost when a warm process is not there (a restarted worker group, a warm process
that failed to import, a user's own torchrun): the rank then runs in its own process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longctx_cli.launcher.startup import RANK_CREATED_ENV

# The folder with one socket per local rank (`<LOCAL_RANK>.sock`), in the ranks' environment.
WARM_RANKS_ENV = "LONGCTX_WARM_RANKS"
# `python -m longctx_cli.rank WARM_FLAG SOCKET ALIVE_FD STDERR_FD COMMAND ...`: a warm rank.
WARM_FLAG = "--warm"
# What torchrun's agent may send its workers: passed on to the warm process running the rank.
PASSED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
# How long `close` waits for a warm process that ran a rank to finish its exit (it reported
# its status already; its atexit work, such as closing metric writers, may still run).
EXIT_WAIT_S = 60.0


class WarmRanks:
    """The launcher's side: `count` warm processes for the ranks of `rank_argv` (what
    torchrun will run after `-m longctx_cli.rank`), started with `env` (the ranks' own,
    less what torchrun adds)."""

    def __init__(self, rank_module: str, rank_argv: list[str], count: int,
                 env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="longctx-ranks-"))
        # Its read end is every warm process's: at EOF (the launcher is gone, or `close`)
        # one that has not taken a rank over ends.
        alive_read, self._alive_write = os.pipe()
        # Until a warm process runs a rank its stderr is /dev/null (an import that fails
        # there, or a Ctrl-C, must print nothing: the rank then runs in its own process and
        # says what there is to say); the real one goes along for after.
        stderr_fd = os.dup(sys.stderr.fileno())
        self.processes: list[subprocess.Popen] = []
        try:
            for local_rank in range(count):
                # Listening before torchrun starts: a rank that connects while its warm
                # process is still starting waits for it (and gets a reset if it died).
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                    listener.bind(str(self.socket_path(local_rank)))
                    listener.listen(1)
                    self.processes.append(subprocess.Popen(
                        # -u: unbuffered, as torchrun starts a rank (its lines as they come).
                        [sys.executable, "-u", "-m", rank_module, WARM_FLAG,
                         str(listener.fileno()), str(alive_read), str(stderr_fd), *rank_argv],
                        env=env, pass_fds=(listener.fileno(), alive_read, stderr_fd),
                        stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        finally:
            os.close(alive_read)
            os.close(stderr_fd)

    def socket_path(self, local_rank: int) -> Path:
        return self.folder / f"{local_rank}.sock"

    def environment(self) -> dict[str, str]:
        """What the ranks' environment needs to find their warm processes."""
        return {WARM_RANKS_ENV: str(self.folder)}

    def close(self) -> None:
        """End the warm processes no rank took over; wait for those that ran one (idempotent)."""
        if self._alive_write is not None:
            os.close(self._alive_write)
            self._alive_write = None
        deadline = time.monotonic() + EXIT_WAIT_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def serve(args: list[str], warm_up: Callable[[list[str]], None],
          run: Callable[[list[str]], int]) -> int:
    """The warm process (`args`: LISTENER_FD ALIVE_FD STDERR_FD RANK_ARGV...): `warm_up`
    (import what the rank will), take over the rank that connects and `run` it; its status.
    """
    listener = socket.socket(fileno=int(args[0]))
    alive_fd, stderr_fd, rank_argv = int(args[1]), int(args[2]), args[3:]
    taken = threading.Event()

    def end_with_the_launcher() -> None:
        while os.read(alive_fd, 1):
            pass
        if not taken.is_set():
            os._exit(0)

    threading.Thread(target=end_with_the_launcher, daemon=True).start()
    try:
        warm_up(rank_argv)
        connection, _ = listener.accept()
    except BaseException:  # noqa: BLE001 - the rank runs in its own process instead
        return 1
    taken.set()
    listener.close()
    reader = connection.makefile("rb")
    try:
        handed = json.loads(reader.readline())
    except ValueError:
        return 1  # the rank went before it handed anything over
    os.dup2(stderr_fd, sys.stderr.fileno())
    os.close(stderr_fd)
    os.environ.clear()
    os.environ.update(handed["env"])
    os.environ[RANK_CREATED_ENV] = repr(handed["created"])
    os.chdir(handed["cwd"])
    sys.argv = [sys.argv[0], *handed["argv"]]
    connection.sendall(f"started {os.getpid()}\n".encode())
    finished = threading.Event()

    def end_with_the_rank() -> None:
        # The rank torchrun started is this rank's handle: killed (torchrun's last resort),
        # it takes this process with it.
        with contextlib.suppress(OSError):
            while reader.read(1):
                pass
        if not finished.is_set():
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=end_with_the_rank, daemon=True).start()
    try:
        status = run(handed["argv"])
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - as Python ends on an uncaught error
        sys.excepthook(*sys.exc_info())  # (torch.distributed's names the rank)
        status = 1
    finished.set()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        connection.sendall(f"exit {status}\n".encode())
    return status


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def hand_over(argv: list[str], created: float) -> int | None:
    """In the rank torchrun started: hand it to its warm process and wait for its status.
    None when there is no warm process to take it (run it here)."""
    folder = os.environ.get(WARM_RANKS_ENV)
    local_rank = os.environ.get("LOCAL_RANK")
    if not folder or local_rank is None:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(Path(folder) / f"{local_rank}.sock"))
    except OSError:
        connection.close()
        return None
    env = {k: v for k, v in os.environ.items() if k != WARM_RANKS_ENV}
    handed = {"argv": argv, "env": env, "cwd": os.getcwd(), "created": created}
    reader = connection.makefile("rb")
    try:
        connection.sendall(json.dumps(handed).encode() + b"\n")
        started = reader.readline()
    except OSError:
        started = b""
    if not started.startswith(b"started "):
        connection.close()
        return None  # it ended before it took the rank over: nothing ran there
    pid = int(started.split()[1])

    def pass_on(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for name in PASSED_SIGNALS:
        signal.signal(getattr(signal, name), pass_on)
    try:
        ended = reader.readline()
    except OSError:
        ended = b""
    if ended.startswith(b"exit "):
        return int(ended.split()[1])
    # It went without a status: killed (the OOM killer, a hang's teardown). Say so to
    # torchrun the same way.
    os.kill(os.getpid(), signal.SIGKILL)
    return 128 + signal.SIGKILL  # not reached

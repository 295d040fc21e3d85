"""A rank program for tests/test_warm_ranks.py: `launcher.warm_ranks` around a `run` that
reports where and how it ran, waits for a signal, or sleeps."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from longctx_cli.launcher.warm_ranks import WARM_FLAG, hand_over, serve


def warm_up(argv: list[str]) -> None:
    Path(argv[1], f"warm-{os.getpid()}").write_text("")  # the warm process got this far


def run(argv: list[str]) -> int:
    mode, folder = argv[0], Path(argv[1])
    me = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "cwd": os.getcwd(),
          "argv": argv, "created": os.environ.get("LONGCTX_RANK_CREATED")}
    if mode == "raise":
        raise RuntimeError("a bug in the rank")
    if mode == "report":
        (folder / f"rank-{me['rank']}.json").write_text(json.dumps(me))
        return int(argv[2])
    if mode == "wait-signal":
        def saved(signum: int, frame: object) -> None:
            (folder / f"signal-{me['rank']}.json").write_text(json.dumps({**me, "sig": signum}))
            sys.exit(75)

        signal.signal(signal.SIGUSR1, saved)
    (folder / f"ready-{me['rank']}.json").write_text(json.dumps(me))
    time.sleep(60)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == [WARM_FLAG]:
        sys.exit(serve(args[1:], warm_up, run))
    status = hand_over(args, time.time())
    sys.exit(run(args) if status is None else status)

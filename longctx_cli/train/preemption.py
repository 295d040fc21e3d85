"""Preemption and progress, rank side: a signal asks for a checkpoint, every rank agrees on it
at the end of an optimizer step, saves, and exits as "preempted, resumable"; a heartbeat file
per rank tells the launcher how far each rank got (for restarts and hang detection).

Signals only set a flag (nothing else is safe inside a handler); the flag is combined over the
world with one all-reduce per optimizer step, so a signal to any single rank, to the launcher
or to all of them ends the run at the same step everywhere. The launcher side is
:mod:`longctx_cli.launcher.supervise`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from longctx_cli.errors import PREEMPTED_EXIT
from longctx_cli.launcher.supervise import PROGRESS_DIR


class Preempted(Exception):
    """Raised out of the loop after the preemption checkpoint is written."""

    exit_code = PREEMPTED_EXIT

    def __init__(self, step: int, checkpoint: Path, signal_name: str):
        super().__init__(f"preempted by {signal_name} after step {step}: checkpoint "
                         f"{checkpoint} is complete; run the same command to resume.")
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


class PreemptionSignals:
    """Handlers for the configured signals (main thread only) that remember the first one."""

    def __init__(self, names: list[str]):
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum  # a second signal (during the save) changes nothing

    def agreed(self, device: torch.device) -> str | None:
        """The signal any rank received, or None: a collective, call it on every rank."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value).name if value else None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class Progress:
    """This rank's progress file: the last finished step and a heartbeat every second.

    The launcher reads them: a worker group that made no step for `step_timeout_s` is stuck,
    and a rank whose heartbeat stopped is the one that hangs (a stopped or wedged process)."""

    BEAT_S = 1.0

    def __init__(self, output_dir: Path, rank: int):
        self.path = output_dir / PROGRESS_DIR / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.step, self.step_time = rank, None, time.time()
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="longctx-heartbeat",
                                        daemon=True)
        self._thread.start()

    def step_done(self, step: int) -> None:
        with self._lock:
            self.step, self.step_time = step, time.time()
        self._write()

    def _beat(self) -> None:
        while not self._stop.wait(self.BEAT_S):
            self._write()

    def _write(self) -> None:
        with self._lock:
            record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self.step,
                      "step_time": self.step_time, "beat": time.time()}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass  # progress is advisory: never let it stop training

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

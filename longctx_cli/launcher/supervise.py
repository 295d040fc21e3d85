"""The launcher's watch over a training job: preemption signals, restarts, hangs.

`longctx train` runs the torchrun job (:func:`.launch.launch_torchrun`) under a supervisor:

* a preemption signal (``preemption_signals``) to the launcher is passed on to the job;
  torchrun passes it to every rank (``--signals-to-handle``) and gives them
  ``preemption_grace_s`` (``--shutdown-timeout``) to finish the step and save
  (:mod:`longctx_cli.train.preemption`); the launcher then exits 75 (resumable);
* a worker group that fails (a rank killed, a crash, a collective error) is started again up
  to ``max_restarts`` times, resuming from the newest intact checkpoint by itself; a user
  error (exit 2: config, data, NaN) is never retried and the same fault at the same
  checkpoint twice in a row stops the retries;
* with ``step_timeout_s``, a job whose ranks finish no optimizer step for that long is
  stopped (its worker processes killed), naming the rank that stopped answering, and
  restarted or ended like a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from longctx_cli.errors import PREEMPTED_EXIT, UserError
from longctx_cli.launcher.launch import (
    FAILURE_FILE_ENV,
    EarlyTorchrun,
    TorchrunJob,
    started_torchrun,
    torchrun_command,
)

# In output_dir, written by the ranks (train/preemption.py): one `rank-<N>.json` progress
# file per rank, rewritten at every optimizer step and every second (heartbeat) ...
PROGRESS_DIR = ".progress"
# ... and the marker of a complete preemption checkpoint: while it is there, the next
# `longctx train` of the same config resumes (no config edit); a finished run removes it.
PREEMPTED_MARKER = "preempted.json"
# Set for a restarted worker group: resume as `resume_from_checkpoint: auto` does.
RESUME_ENV = "LONGCTX_RESUME"
POLL_S = 0.5
# A rank whose heartbeat (written every second) is older than this (or than half the step
# timeout, if shorter) has stopped responding.
STALE_BEAT_S = 10.0
# After a hang: how long to wait for the killed torchrun process to be reaped.
TEARDOWN_S = 30.0


@dataclass(frozen=True)
class Supervision:
    output_dir: Path
    max_restarts: int = 0
    step_timeout_s: float | None = None
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    grace_s: int = 600

    @classmethod
    def of(cls, config) -> Supervision:
        run = config.run
        return cls(Path(config.output.output_dir), run.max_restarts, run.step_timeout_s,
                   tuple(run.preemption_signals), run.preemption_grace_s)


@dataclass
class Attempt:
    """How one run of the torchrun job ended."""

    returncode: int
    preempted: bool = False  # every rank saved and exited 75
    signalled: bool = False  # the launcher passed a preemption signal on
    failure: str | None = None  # the one-line reason (torchrun's or the hang's)


def supervise(command_args: list[str], world_size: int, nproc_per_node: int | None,
              nnodes: int, node_rank: int, rdzv_endpoint: str | None,
              sup: Supervision, early: EarlyTorchrun | None = None) -> int:
    """Run the job until it succeeds, is preempted, fails for good or runs out of restarts;
    the launcher's exit status. `early`: torchrun started ahead, for the first attempt."""
    job = torchrun_command(command_args, world_size, nproc_per_node, nnodes, node_rank,
                           rdzv_endpoint, signals=sup.signals, shutdown_timeout=sup.grace_s)
    previous: tuple[str | None, str | None] | None = None
    for attempt in range(sup.max_restarts + 1):
        result = run_attempt(job, sup, early if attempt == 0 else None, warm=attempt == 0)
        if result.returncode == 0:
            return 0
        if result.preempted:
            marker = _read_json(sup.output_dir / PREEMPTED_MARKER) or {}
            print(f"preempted ({marker.get('signal', 'signal')}): "
                  f"{marker.get('checkpoint', 'the checkpoint')} in {sup.output_dir} is "
                  "complete; run the same command to resume.", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        if result.signalled or result.returncode == UserError.exit_code \
                or attempt == sup.max_restarts:  # told to stop, or a fault of the user's
            return result.returncode
        where = newest_checkpoint(sup.output_dir)
        if previous == (_kind_of(result.failure), where):
            print(f"error: the same fault again from {where or 'the start'}: not retried "
                  f"({attempt} restart(s) used of {sup.max_restarts}).",
                  file=sys.stderr, flush=True)
            return result.returncode
        previous = (_kind_of(result.failure), where)
        print(f"restarting the worker group ({attempt + 1} of {sup.max_restarts}) from "
              f"{where or 'the start'}.", file=sys.stderr, flush=True)
        job = job.with_env({RESUME_ENV: "auto"})
    return 1  # not reached: the last attempt returns above


def _kind_of(failure: str | None) -> str | None:
    """A failure without what differs between attempts of the same fault: pids, seconds and
    which rank was first (every rank may meet the same bug at the same step)."""
    if failure is None:
        return None
    return re.sub(r"\b(rank|pid) \d+|\d+ s\b", lambda m: m.group(1) or "", failure)


def write_marker(output_dir: Path, step: int, checkpoint: Path, signal_name: str) -> None:
    """Record a completed preemption checkpoint (rank 0), atomically."""
    record = {"step": step, "checkpoint": checkpoint.name, "signal": signal_name,
              "time": time.time()}
    tmp = output_dir / f".{PREEMPTED_MARKER}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, output_dir / PREEMPTED_MARKER)


def read_marker(output_dir: Path) -> dict | None:
    try:
        return json.loads((output_dir / PREEMPTED_MARKER).read_text())
    except (OSError, ValueError):
        return None


def clear_marker(output_dir: Path) -> None:
    (output_dir / PREEMPTED_MARKER).unlink(missing_ok=True)


def resume_setting(configured: str | None, output_dir: Path) -> str | None:
    """`resume_from_checkpoint` as the run uses it: a preempted run's output_dir, or a worker
    group the launcher restarted, resumes from the newest intact checkpoint."""
    if configured is not None:
        return configured
    if os.environ.get(RESUME_ENV) == "auto" or read_marker(output_dir) is not None:
        return "auto"
    return None


def newest_checkpoint(output_dir: Path) -> str | None:
    """Name of the newest complete `checkpoint-<step>` (a manifest is written last)."""
    steps = []
    for path in output_dir.glob("checkpoint-*"):
        suffix = path.name.removeprefix("checkpoint-")
        if suffix.isdigit() and path.is_dir():
            steps.append(int(suffix))
    return f"checkpoint-{max(steps)}" if steps else None


def run_attempt(job: TorchrunJob, sup: Supervision, early: EarlyTorchrun | None = None,
                warm: bool = False) -> Attempt:
    """Start the torchrun job once (in `early`'s waiting process, when given; with `warm`,
    its ranks run in processes that imported ahead) and watch it: pass preemption signals
    on, stop it when it hangs. Returns how it ended."""
    with tempfile.TemporaryDirectory(prefix="longctx-") as tmp:
        failure_file = Path(tmp) / "failure.json"
        started = time.time()
        with started_torchrun(job.with_env({FAILURE_FILE_ENV: str(failure_file)}), early,
                              warm) as proc:
            forwarded: list[str] = []

            def forward(signum: int, frame: FrameType | None) -> None:
                if not forwarded:  # a second signal must not cut the save short: not passed on
                    proc.send_signal(signum)
                forwarded.append(signal.Signals(signum).name)

            previous = {sig: signal.signal(sig, forward)
                        for sig in (getattr(signal, name) for name in sup.signals)}
            hang: str | None = None
            try:
                while proc.poll() is None:
                    time.sleep(POLL_S)
                    if hang is None and not forwarded and sup.step_timeout_s is not None:
                        hang = find_hang(sup.output_dir, started, sup.step_timeout_s)
                        if hang is not None:
                            print(f"error: {hang}", file=sys.stderr, flush=True)
                            _stop(proc, sup.output_dir, started)
                returncode = proc.wait()
            except KeyboardInterrupt:
                proc.wait()
                return Attempt(130, signalled=True)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            failure = hang or (_read_json(failure_file) or {}).get("message")
            marker = _read_json(sup.output_dir / PREEMPTED_MARKER) or {}
            preempted = returncode == PREEMPTED_EXIT or (
                bool(forwarded) and marker.get("time", 0) >= started)
            return Attempt(1 if hang else returncode, preempted, bool(forwarded), failure)


def rank_progress(output_dir: Path, since: float) -> dict[int, dict]:
    """The progress records of ranks of the job started at `since` (older files are left
    over from an earlier attempt)."""
    out = {}
    for path in (output_dir / PROGRESS_DIR).glob("rank-*.json"):
        record = _read_json(path)
        if record and record.get("beat", 0) >= since and "rank" in record:
            out[int(record["rank"])] = record
    return out


def find_hang(output_dir: Path, since: float, timeout_s: float,
              now: float | None = None) -> str | None:
    """The reason the job counts as hung, or None: its ranks reached the training loop and no
    optimizer step has finished for `timeout_s` seconds."""
    now = time.time() if now is None else now
    ranks = rank_progress(output_dir, since)
    if not ranks:
        return None  # not in the loop yet (loading, probing): not timed
    last = max(r["step_time"] for r in ranks.values())
    if now - last <= timeout_s:
        return None
    stale_after = min(STALE_BEAT_S, timeout_s / 2)
    stale = sorted(r for r, rec in ranks.items() if now - rec["beat"] > stale_after)
    step = max((rec["step"] or 0) for rec in ranks.values())
    head = f"no optimizer step finished for {now - last:.0f} s (step_timeout_s {timeout_s:g}) "
    if stale:
        who = ", ".join(f"rank {r} (pid {ranks[r]['pid']}, last heartbeat "
                        f"{now - ranks[r]['beat']:.0f} s ago)" for r in stale)
        return head + f"after step {step}: {who} stopped responding; the other ranks wait for " \
                      "it in a collective."
    return head + (f"after step {step}: every rank is alive but none progresses (a collective "
                   "that never completes); ranks " + ", ".join(map(str, sorted(ranks))) + ".")


def _stop(proc: subprocess.Popen, output_dir: Path, since: float) -> None:
    """End a hung job: torchrun first (it would wait for its workers, then report their
    deaths as the cause), then this node's worker processes."""
    proc.kill()
    proc.wait(timeout=TEARDOWN_S)
    here = socket.gethostname()
    for record in rank_progress(output_dir, since).values():
        if record.get("host") != here:
            continue  # another node's rank (a shared output_dir): its launcher stops it
        try:
            os.kill(int(record["pid"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass  # on another node, or gone already


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

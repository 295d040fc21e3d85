"""A killed rank, or a kill during a checkpoint save, costs only the steps since the last
complete checkpoint: the job ends quickly, and `resume_from_checkpoint: auto` finishes it
with the same metrics and weights as an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from longctx_cli.train.checkpoint_files import list_checkpoints, resolve_resume
from tests.shown_outputs import assert_shown_message
from tests.train_helpers import (
    IN_A_RANK,
    assert_same_run,
    read_metrics,
    train,
    write_config,
    write_documents,
)

MAX_STEPS = 10
SAVE_STEPS = 3
COMMON = {
    "sequence_parallel_degree": 2,
    "gradient_accumulation_steps": 1,
    "max_steps": MAX_STEPS,
    "save_steps": SAVE_STEPS,
    "collective_timeout_s": 30,
}

# Test-only faults, loaded into every process of a run through PYTHONPATH. Ranks only (RANK
# is set by torchrun; a warm process that will run a rank has `--warm`), never the launcher.
# Sleeping changes no numbers, only timing.
FAULTS = f"""
import os, sys, time
if {IN_A_RANK}:
    import torch
    _step_sleep = float(os.environ.get("LONGCTX_TEST_STEP_SLEEP", "0"))
    if _step_sleep:
        _adamw_step = torch.optim.AdamW.step
        def _slow_step(self, *args, **kwargs):
            time.sleep(_step_sleep)
            return _adamw_step(self, *args, **kwargs)
        torch.optim.AdamW.step = _slow_step
    _hang_in = os.environ.get("LONGCTX_TEST_HANG_SAVING")
    if _hang_in:
        _torch_save = torch.save
        def _hanging_save(obj, f, *args, **kwargs):
            if _hang_in in str(f):
                time.sleep(600)
            return _torch_save(obj, f, *args, **kwargs)
        torch.save = _hanging_save
"""


def _env(fault_dir: Path, **faults: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(fault_dir), **faults}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _start(config: Path, env: dict[str, str]) -> subprocess.Popen:
    # Output goes to a file: a pipe nobody reads while we wait could fill up and stall the run.
    with config.with_suffix(".log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "longctx_cli", "train", str(config), "--nproc-per-node", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _output(proc: subprocess.Popen) -> str:
    """Everything the run printed so far (its config path is the 5th argument)."""
    return Path(proc.args[4]).with_suffix(".log").read_text(errors="replace")


def _wait_for(condition, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{_output(proc)[-4000:]}")
        if time.monotonic() > deadline:
            _kill_tree(proc)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """The process running each global rank of a `longctx train` process, as its progress
    records name them (the hang detector's source too): a warm process that runs a rank
    learnt its RANK at the hand-over, which /proc/PID/environ does not show."""
    import yaml

    from longctx_cli.launcher.supervise import rank_progress

    config = yaml.safe_load(Path(proc.args[4]).read_text())
    since = psutil.Process(proc.pid).create_time()
    found = {}
    for rank, record in rank_progress(Path(config["output_dir"]), since).items():
        try:
            found[rank] = psutil.Process(int(record["pid"]))
        except psutil.NoSuchProcess:
            continue
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """Cleanup after a failed assertion: no stray ranks left behind."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait(timeout=30)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail(f"the job did not end within {timeout} s of a rank's death")
    return proc.returncode, _output(proc)


def _metric_lines(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(work dir, data file, uninterrupted reference run)."""
    path = tmp_path_factory.mktemp("kill")
    data = write_documents(path / "docs.jsonl", seed=3)
    (path / "faults").mkdir()
    (path / "faults" / "sitecustomize.py").write_text(FAULTS)
    straight = write_config(path, "straight", data, **COMMON)
    train(straight, 2)
    return path, data, path / "straight"


@pytest.mark.slow  # test_reliability_restart kills a rank and compares in the default run
def test_killed_rank_ends_job_and_resume_matches_uninterrupted(runs):
    path, data, straight = runs
    rng = random.Random(20240611)
    kill_after = rng.randint(2, MAX_STEPS - 3)  # steps logged before the kill
    victim = rng.randint(0, 1)
    config = write_config(path, "killed", data, **COMMON)
    output_dir = path / "killed"
    # Slow steps so that the kill lands mid-run, not after the last step.
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_STEP_SLEEP="0.5"))
    _wait_for(lambda: _metric_lines(output_dir) >= kill_after, proc, 240, "the steps to log")
    _wait_for(lambda: victim in _workers(proc), proc, 10, "the workers to be found")
    pid = _workers(proc)[victim].pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code, out = _finish(proc, timeout=90)
    assert time.monotonic() - killed_at < 60
    assert code != 0
    assert f"train failed: rank {victim} " in out and "SIGKILL" in out, out[-3000:]
    assert_shown_message("rank-killed", out)
    assert not (output_dir / "final").exists()
    logged = len(read_metrics(output_dir))
    assert kill_after <= logged < MAX_STEPS

    # The kill may land between steps or inside a save: only complete checkpoints count.
    complete = list_checkpoints(output_dir)
    assert all(step <= logged for step, _ in complete)
    resumed = write_config(path, "killed", data, resume_from_checkpoint="auto", **COMMON)
    result = train(resumed, 2)
    if complete:
        assert f"at step {complete[-1][0]}" in result.stdout + result.stderr
    assert_same_run(output_dir, straight, tol=1e-6)


@pytest.mark.slow  # a kill at any moment (the test above) may land in a save too
def test_kill_during_save_never_yields_that_checkpoint(runs):
    path, data, straight = runs
    config = write_config(path, "killed_saving", data, **COMMON)
    output_dir = path / "killed_saving"
    saving = f"checkpoint-{2 * SAVE_STEPS}.tmp"
    # Every rank stops inside its torch.save into the second checkpoint's temp folder.
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_HANG_SAVING=saving))
    _wait_for(lambda: (output_dir / saving / "state").exists(), proc, 240, "the save to start")
    _wait_for(lambda: 0 in _workers(proc), proc, 10, "the workers to be found")
    time.sleep(1.0)  # let both ranks reach the hanging torch.save
    os.kill(_workers(proc)[0].pid, signal.SIGKILL)
    code, out = _finish(proc, timeout=90)
    assert code != 0

    assert (output_dir / saving).is_dir()
    assert not (output_dir / f"checkpoint-{2 * SAVE_STEPS}").exists()
    picked = resolve_resume("auto", output_dir)
    assert picked == output_dir / f"checkpoint-{SAVE_STEPS}"

    resumed = write_config(path, "killed_saving", data, resume_from_checkpoint="auto", **COMMON)
    result = train(resumed, 2)
    assert f"at step {SAVE_STEPS}" in result.stdout + result.stderr
    assert_same_run(output_dir, straight, tol=1e-6)


def test_failure_summary_names_the_rank_that_died_first():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from longctx_cli.launcher.launch import describe_failure, failure_exit_code

    # Rank 1 was killed; torchrun then stopped rank 0 with SIGTERM.
    killed = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file="<N/A>"),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file="<N/A>"),
    }
    line = describe_failure(killed)
    assert line.startswith("train failed: rank 1 (local rank 1, pid 101) was killed by SIGKILL")
    assert "resume_from_checkpoint: auto" in line
    assert_shown_message("rank-killed", f"error: {line}")  # as the launcher prints it
    assert failure_exit_code(killed) == 1
    # A rank that stopped on a UserError already printed it: keep its exit status 2.
    user_error = {0: ProcessFailure(local_rank=0, pid=100, exitcode=2, error_file="<N/A>")}
    assert "reported the error above" in describe_failure(user_error, "eval")
    assert failure_exit_code(user_error) == 2

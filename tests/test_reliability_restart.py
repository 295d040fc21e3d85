"""Long runs without a person: a preemption signal ends the run with a complete checkpoint
and exit status 75, and the same command resumes it; `max_restarts` restarts a worker group
that lost a rank; a deterministic fault is not retried; a stuck rank is named within
`step_timeout_s`. Every finished run must equal the uninterrupted one."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from longctx_cli.errors import PREEMPTED_EXIT
from longctx_cli.launcher.supervise import PREEMPTED_MARKER, find_hang
from longctx_cli.train.checkpoint_files import list_checkpoints
from tests.test_nonfinite import FAULTS as NAN_FAULTS
from tests.test_reliability_kill import (
    COMMON,
    FAULTS,
    MAX_STEPS,
    _env,
    _finish,
    _metric_lines,
    _start,
    _wait_for,
    _workers,
)
from tests.train_helpers import (
    IN_A_RANK,
    assert_same_run,
    read_metrics,
    train,
    write_config,
    write_documents,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(work dir, data file, uninterrupted reference run)."""
    path = tmp_path_factory.mktemp("restart")
    data = write_documents(path / "docs.jsonl", seed=3)
    (path / "faults").mkdir()
    (path / "faults" / "sitecustomize.py").write_text(FAULTS + NAN_FAULTS)
    straight = write_config(path, "straight", data, **COMMON)
    train(straight, 2)
    return path, data, path / "straight"


@pytest.mark.parametrize(("target", "sig"), [
    ("launcher", signal.SIGTERM),
    pytest.param("rank", signal.SIGUSR1, marks=pytest.mark.slow),  # same path, one rank
])
def test_preemption_saves_exits_75_and_the_same_command_resumes(runs, target, sig):
    path, data, straight = runs
    rng = random.Random(f"{target}-{sig}")
    at = rng.randint(2, MAX_STEPS - 3)
    name = f"preempted_{target}"
    config = write_config(path, name, data, **COMMON)
    output_dir = path / name
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_STEP_SLEEP="0.5"))
    _wait_for(lambda: _metric_lines(output_dir) >= at, proc, 240, "the steps to log")
    if target == "launcher":
        proc.send_signal(sig)
        time.sleep(0.3)
        proc.send_signal(sig)  # a second signal, during the step or the save, changes nothing
    else:
        _wait_for(lambda: 1 in _workers(proc), proc, 10, "the workers to be found")
        os.kill(_workers(proc)[1].pid, sig)
    signalled = time.monotonic()
    code, out = _finish(proc, timeout=120)
    assert code == PREEMPTED_EXIT, out[-3000:]
    assert time.monotonic() - signalled < 60  # one step (0.5 s + compute) and a save
    assert "preempted" in out and "run the same command to resume" in out, out[-3000:]
    logged = len(read_metrics(output_dir))
    assert at <= logged < MAX_STEPS
    # The checkpoint of the last logged step is complete, and marked for the next run.
    assert list_checkpoints(output_dir)[-1][0] == logged
    assert (output_dir / PREEMPTED_MARKER).exists()

    result = train(config, 2)  # the same command, the same config: no resume key added
    assert f"at step {logged}" in result.stdout + result.stderr
    assert not (output_dir / PREEMPTED_MARKER).exists()
    assert_same_run(output_dir, straight, tol=1e-6)


def test_killed_rank_is_restarted_and_the_run_completes(runs):
    path, data, straight = runs
    rng = random.Random(31)
    kill_after, victim = rng.randint(2, MAX_STEPS - 3), rng.randint(0, 1)
    config = write_config(path, "restarted", data, max_restarts=1, **COMMON)
    output_dir = path / "restarted"
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_STEP_SLEEP="0.5"))
    _wait_for(lambda: _metric_lines(output_dir) >= kill_after, proc, 240, "the steps to log")
    _wait_for(lambda: victim in _workers(proc), proc, 10, "the workers to be found")
    os.kill(_workers(proc)[victim].pid, signal.SIGKILL)
    code, out = _finish(proc, timeout=300)
    assert code == 0, out[-4000:]
    line = next(x for x in out.splitlines() if "restarting the worker group (1 of 1)" in x)
    if "from checkpoint-" in line:  # the new workers resumed from it by themselves
        step = int(line.split("from checkpoint-")[1].rstrip("."))
        assert f"at step {step}" in out
    assert_same_run(output_dir, straight, tol=1e-6)


@pytest.mark.slow  # the restart logic stays by default in the two tests above
def test_deterministic_fault_is_not_retried(runs):
    path, data, _ = runs
    config = write_config(path, "nan", data, max_restarts=3, on_nonfinite="stop", **COMMON)
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_POISON_WEIGHT_AFTER_STEP="3",
                               LONGCTX_TEST_FAULT_RANK="0"))
    code, out = _finish(proc, timeout=300)
    assert code == 2, out[-3000:]
    assert "restarting" not in out
    assert out.count("is NaN or infinite; training stopped") == 1, out[-3000:]


def test_stopped_rank_is_named_within_the_step_timeout(runs):
    path, data, _ = runs
    timeout_s = 6.0
    config = write_config(path, "hung", data, step_timeout_s=timeout_s, **COMMON)
    output_dir = path / "hung"
    proc = _start(config, _env(path / "faults", LONGCTX_TEST_STEP_SLEEP="0.2"))
    _wait_for(lambda: _metric_lines(output_dir) >= 2, proc, 240, "the steps to log")
    _wait_for(lambda: 1 in _workers(proc), proc, 10, "the workers to be found")
    victim = _workers(proc)[1]
    assert "--warm" in victim.cmdline()  # a first attempt's ranks run in warm processes
    victim.suspend()  # SIGSTOP: alive, but it never reaches the next collective
    stopped = time.monotonic()
    code, out = _finish(proc, timeout=120)
    took = time.monotonic() - stopped
    assert code == 1, out[-3000:]
    # Detected after the timeout, within the heartbeat staleness and polling margin.
    assert timeout_s <= took < timeout_s + 45, took
    assert f"rank 1 (pid {victim.pid}" in out and "stopped responding" in out, out[-3000:]


def test_find_hang_reads_progress_files(tmp_path: Path):
    import json

    progress = tmp_path / ".progress"
    progress.mkdir()
    now = 1000.0
    for rank, beat in ((0, now - 1), (1, now - 30)):
        (progress / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "pid": 10 + rank, "step": 4, "step_time": now - 40, "beat": beat}))
    assert find_hang(tmp_path, since=900.0, timeout_s=60, now=now) is None
    reason = find_hang(tmp_path, since=900.0, timeout_s=20, now=now)
    assert reason is not None and "rank 1 (pid 11" in reason and "rank 0" not in reason
    assert find_hang(tmp_path, since=now, timeout_s=20, now=now) is None  # an older attempt's


@pytest.mark.slow
def test_two_nodes_one_node_lost_is_restarted_and_completes(runs):
    """Two launchers on this machine (`--nnodes 2`, c10d rendezvous), one rank each: the
    second node's worker is killed mid-run; both launchers restart their workers, which meet
    again at the rendezvous and finish equal to the uninterrupted one-node run."""
    import socket
    import subprocess
    import sys

    import psutil

    path, data, straight = runs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = write_config(path, "two_nodes", data, max_restarts=1, **COMMON)
    output_dir = path / "two_nodes"
    env = _env(path / "faults", LONGCTX_TEST_STEP_SLEEP="0.5")
    procs = []
    for node in (0, 1):
        log = (path / f"node{node}.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "longctx_cli", "train", str(config), "--nproc-per-node", "1",
             "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        _wait_for(lambda: _metric_lines(output_dir) >= 4, procs[0], 300, "the steps to log")
        worker = next(c for c in psutil.Process(procs[1].pid).children(recursive=True)
                      if c.environ().get("RANK") is not None)
        worker.kill()
        for proc in procs:
            proc.wait(timeout=400)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    logs = [(path / f"node{n}.log").read_text(errors="replace") for n in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert all("restarting the worker group (1 of 1)" in log for log in logs)
    assert_same_run(output_dir, straight, tol=1e-6)


CRASH = f"""
import os, sys
if {IN_A_RANK} and os.environ.get("LONGCTX_TEST_CRASH_FROM_STEP"):
    import torch
    _from = int(os.environ["LONGCTX_TEST_CRASH_FROM_STEP"])
    _adamw_step = torch.optim.AdamW.step
    def _crashing_step(self, *args, **kwargs):
        state = self.state.get(self.param_groups[0]["params"][0], {{}})
        if int(state.get("step", 0)) + 1 >= _from:  # the global step, restored on resume
            raise RuntimeError("a bug that strikes at the same step every time")
        return _adamw_step(self, *args, **kwargs)
    torch.optim.AdamW.step = _crashing_step
"""


@pytest.mark.slow
def test_a_crash_at_the_same_step_is_retried_once_not_forever(runs):
    path, data, _ = runs
    (path / "crash").mkdir(exist_ok=True)
    (path / "crash" / "sitecustomize.py").write_text(CRASH)
    config = write_config(path, "crash", data, max_restarts=3, **COMMON)
    proc = _start(config, _env(path / "crash", LONGCTX_TEST_CRASH_FROM_STEP="5"))
    code, out = _finish(proc, timeout=400)
    assert code == 1, out[-3000:]
    assert out.count("restarting the worker group") == 1, out[-3000:]
    assert "the same fault again from checkpoint-3: not retried" in out, out[-3000:]


def test_the_same_fault_on_another_rank_is_the_same_fault():
    from longctx_cli.launcher.supervise import _kind_of

    first = "train failed: rank 0 (local rank 0, pid 27639) exited with status 1; ..."
    again = "train failed: rank 1 (local rank 1, pid 30011) exited with status 1; ..."
    assert _kind_of(first) == _kind_of(again)
    assert _kind_of(first) != _kind_of(first.replace("exited with status 1",
                                                     "was killed by SIGKILL"))

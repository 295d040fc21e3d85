"""Warm rank processes (`launcher.warm_ranks`): the rank torchrun starts hands itself to the
process that imported ahead; that process runs it with the rank's environment, working
directory and arguments, signals reach it, its exit status is the rank's, and either side's
death takes the other with it. Without a warm process a rank runs by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx_cli.launcher.warm_ranks import WARM_RANKS_ENV, WarmRanks

PROGRAM = "tests.warm_rank_program"
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", WARM_RANKS_ENV):
        env.pop(key, None)
    return env


def _rank(warm: WarmRanks | None, rank: int, args: list[str], cwd: Path) -> subprocess.Popen:
    """A rank as torchrun would start it: its own environment, `python -m PROGRAM ARGS`."""
    env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    if warm is not None:
        env.update(warm.environment())
    return subprocess.Popen([sys.executable, "-m", PROGRAM, *args], env=env, cwd=cwd)


def _wait_for(path: Path, what: str) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def warm(tmp_path):
    made: list[WarmRanks] = []

    def start(args: list[str], count: int = 2) -> WarmRanks:
        made.append(WarmRanks(PROGRAM, args, count, _env()))
        return made[-1]

    yield start
    for w in made:
        w.close()


def test_the_rank_runs_in_its_warm_process_with_its_own_environment(warm, tmp_path):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    args = ["report", str(tmp_path), "3"]
    ranks = warm(args)
    warm_pids = {p.pid for p in ranks.processes}
    procs = [_rank(ranks, r, args, workdir) for r in (0, 1)]
    assert [p.wait(timeout=TIMEOUT_S) for p in procs] == [3, 3]  # the run's status
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert {r["pid"] for r in reports} == warm_pids  # each in a warm process, one each
    assert all(r["pid"] not in {p.pid for p in procs} for r in reports)
    assert [r["rank"] for r in reports] == ["0", "1"]
    assert all(r["cwd"] == str(workdir) and r["argv"] == args for r in reports)
    assert all(float(r["created"]) > 0 for r in reports)  # the rank's creation, for the clock
    assert {p.name for p in tmp_path.glob("warm-*")} == {f"warm-{pid}" for pid in warm_pids}
    ranks.close()
    assert all(p.returncode is not None for p in ranks.processes)
    assert not ranks.folder.exists()


def test_a_signal_to_the_rank_reaches_its_warm_process(warm, tmp_path):
    args = ["wait-signal", str(tmp_path)]
    ranks = warm(args, count=1)
    proc = _rank(ranks, 0, args, tmp_path)
    ready = _wait_for(tmp_path / "ready-0.json", "the rank to run")
    assert ready["pid"] == ranks.processes[0].pid
    proc.send_signal(signal.SIGUSR1)  # as torchrun passes a preemption signal on
    assert proc.wait(timeout=TIMEOUT_S) == 75
    assert _wait_for(tmp_path / "signal-0.json", "the signal")["sig"] == signal.SIGUSR1


def test_a_killed_rank_takes_its_warm_process_with_it(warm, tmp_path):
    args = ["sleep", str(tmp_path)]
    ranks = warm(args, count=1)
    proc = _rank(ranks, 0, args, tmp_path)
    running = _wait_for(tmp_path / "ready-0.json", "the rank to run")
    proc.kill()  # torchrun's last resort after its shutdown timeout
    proc.wait(timeout=TIMEOUT_S)
    assert running["pid"] == ranks.processes[0].pid
    assert ranks.processes[0].wait(timeout=10) == -signal.SIGKILL


def test_a_killed_warm_process_shows_as_a_killed_rank(warm, tmp_path):
    args = ["sleep", str(tmp_path)]
    ranks = warm(args, count=1)
    proc = _rank(ranks, 0, args, tmp_path)
    running = _wait_for(tmp_path / "ready-0.json", "the rank to run")
    os.kill(running["pid"], signal.SIGKILL)  # the OOM killer, or a hang's teardown
    assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL  # what torchrun then reports


@pytest.mark.parametrize("how", ["no warm processes", "warm process gone"])
def test_without_a_warm_process_the_rank_runs_itself(warm, tmp_path, how):
    args = ["report", str(tmp_path), "0"]
    ranks = None
    if how == "warm process gone":
        ranks = warm(args, count=1)
        ranks.processes[0].kill()  # e.g. its imports failed
        ranks.processes[0].wait()
    proc = _rank(ranks, 0, args, tmp_path)
    assert proc.wait(timeout=TIMEOUT_S) == 0
    assert json.loads((tmp_path / "rank-0.json").read_text())["pid"] == proc.pid


def test_close_ends_the_waiting_processes_without_a_word(tmp_path):
    code = (f"import os, sys, time\nfrom longctx_cli.launcher.warm_ranks import WarmRanks\n"
            f"w = WarmRanks({PROGRAM!r}, ['report', {str(tmp_path)!r}, '0'], 2, dict(os.environ))\n"
            "time.sleep(float(sys.argv[1]))\nprint(*[p.pid for p in w.processes])\n"
            "w.close()\nprint(*[p.returncode for p in w.processes])\n")
    for wait_s in ("0", "3"):  # mid-start-up, and warm and waiting
        result = subprocess.run([sys.executable, "-c", code, wait_s], capture_output=True,
                                text=True, env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        pids, codes = result.stdout.splitlines()
        assert all(_gone(int(pid)) for pid in pids.split())
        assert all(c in ("0", "-9", "1") for c in codes.split())


def test_a_launcher_gone_ends_the_waiting_processes(tmp_path):
    # The launcher is killed without closing them: their pipe's far end closes with it.
    code = (f"import os\nfrom longctx_cli.launcher.warm_ranks import WarmRanks\n"
            f"w = WarmRanks({PROGRAM!r}, ['report', {str(tmp_path)!r}, '0'], 1, dict(os.environ))\n"
            "print(w.processes[0].pid, flush=True)\nos.kill(os.getpid(), 9)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
    assert _gone(int(result.stdout.split()[0]), timeout=30)


def test_an_uncaught_error_in_the_rank_is_its_traceback_and_status_1(warm, tmp_path):
    args = ["raise", str(tmp_path)]
    ranks = warm(args, count=1)
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", **ranks.environment()}
    proc = subprocess.run([sys.executable, "-m", PROGRAM, *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    ranks.close()
    # The warm process's stderr is the launcher's (here: this test's), not the rank's pipe:
    # what matters is the status torchrun reads, as for an error raised in its own process.
    assert proc.returncode == 1

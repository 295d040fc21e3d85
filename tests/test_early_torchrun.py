"""`longctx train` starts torchrun's agent before it checks the run (`EarlyTorchrun`): the
waiting process runs exactly the command line and environment handed to it, and ends
without a word when the launcher stops first (an error, Ctrl-C)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from longctx_cli.launcher.launch import EarlyTorchrun, torchrun_command

TIMEOUT_S = 120


def test_the_handed_command_runs_with_the_handed_environment(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import json, os, sys
        out = os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json")
        with open(out, "w") as f:
            json.dump({"marker": os.environ.get("EARLY_MARKER"), "args": sys.argv[2:],
                       "world": os.environ["WORLD_SIZE"]}, f)
    """))
    early = EarlyTorchrun()
    # The environment at start-up lacks the marker: only the handed one has it.
    monkeypatch.delenv("EARLY_MARKER", raising=False)
    job = torchrun_command(["unused"], 2, 2)
    command, env = job.command, job.env
    at = command.index("-m", 3)  # torchrun's own arguments end where `-m longctx_cli` begins
    command = [*command[:at], str(worker), str(tmp_path), "a b", "--x"]
    process = early.start(command, {**env, "EARLY_MARKER": "handed"})
    assert not early.waiting
    assert process.wait(timeout=TIMEOUT_S) == 0
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert record == {"marker": "handed", "args": ["a b", "--x"], "world": "2"}
    early.cancel()  # after a hand-over: nothing to end
    assert process.returncode == 0


def _launcher(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script` (a launcher's life with an `EarlyTorchrun` called `early`) in a process of
    its own; its output and its agent's, whose stderr is the launcher's."""
    code = "import os, signal, sys, time\n" \
        "from longctx_cli.launcher.launch import EarlyTorchrun\n" \
        "early = EarlyTorchrun()\n" + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_a_launcher_gone_before_the_hand_over_ends_it_quietly():
    # The launcher exits (an error it reported) without a word to its agent: the agent
    # finishes importing, reads no command and ends; output is read until it has.
    result = _launcher("print(early.process.pid)")
    pid = int(result.stdout)
    assert result.stderr == ""
    # Its output ended when it closed its files on the way out: let the exit finish.
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.5, 3.0])
def test_ctrl_c_before_the_hand_over_prints_nothing(after_s):
    """The terminal's Ctrl-C reaches the agent too, at any moment of its start-up, and the
    launcher (which got it as well) ends it."""
    result = _launcher("""
        time.sleep(float(sys.argv[1]))
        early.process.send_signal(signal.SIGINT)
        time.sleep(0.2)
        early.cancel()
        print(early.process.returncode)
    """, str(after_s))
    assert result.stderr == "" and result.stdout.strip().lstrip("-").isdigit(), result


def test_cancel_ends_a_waiting_process():
    early = EarlyTorchrun()
    early.cancel()
    assert early.process.returncode is not None and not early.waiting


def test_only_train_eval_and_generate_by_hand_start_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for argv in ([], ["validate", "c.yaml"], ["train", "c.yaml", "--help"],
                 ["merge-lora", "c"], ["generate", "c", "-h"]):
        assert EarlyTorchrun.for_command_line(argv) is None
    for argv in (["train", "c.yaml"], ["eval", "c.yaml", "--checkpoint", "x"],
                 ["generate", "c.yaml", "--checkpoint", "x"]):
        early = EarlyTorchrun.for_command_line(argv)
        assert early is not None and early.waiting
        early.cancel()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert EarlyTorchrun.for_command_line(["train", "c.yaml"]) is None  # a rank


def test_a_refused_config_prints_one_paragraph_and_leaves_no_process(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("base_model: nowhere\nsequence_len: -3\n")
    probe = f"EARLY_PROBE_{os.getpid()}_{time.time_ns()}"  # inherited by the agent alone
    result = subprocess.run([sys.executable, "-m", "longctx_cli", "train", str(config)],
                            capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, probe: "1"})
    assert result.returncode == 2 and "sequence_len" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    # The launcher ended its waiting agent before it exited: no process of it is left.
    assert [p for p in Path("/proc").glob("[0-9]*/environ")
            if f"{probe}=".encode() in _read(p)] == []


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped by whoever adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

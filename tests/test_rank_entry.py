"""`python -m longctx_cli.rank`: what the launchers' ranks run, the command without Typer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from longctx_cli.eval.run import _launch_args
from longctx_cli.launcher.launch import RANK_MODULE, rank_command, torchrun_command
from longctx_cli.rank import leading_options


def test_the_eval_launchers_arguments_are_read_back_in_order():
    args = _launch_args(Path("c.yaml"), Path("ck"), Path("other"), ["--seed", "3"])
    assert args[:2] == ["eval", "c.yaml"]
    given, overrides = leading_options(args[2:], ("--checkpoint", "--compare"))
    assert given == {"--checkpoint": "ck", "--compare": "other"} and overrides == ["--seed", "3"]
    given, overrides = leading_options(_launch_args(Path("c.yaml"), Path("ck"), None, [])[2:],
                                       ("--checkpoint", "--compare"))
    assert given == {"--checkpoint": "ck"} and overrides == []


def test_an_override_after_the_options_stays_an_override():
    given, overrides = leading_options(["--checkpoint", "ck", "--max-new-tokens", "8",
                                        "--sequence-len", "64"],
                                       ("--checkpoint", "--max-new-tokens"))
    assert given == {"--checkpoint": "ck", "--max-new-tokens": "8"}
    assert overrides == ["--sequence-len", "64"]


def test_the_launch_runs_the_rank_module_and_names_the_command():
    job = torchrun_command(["train", "c.yaml", "--seed", "1"], 2, 2)
    command = job.command
    assert command[command.index("-m", 3) + 1] == RANK_MODULE
    rank_args = command[command.index("-m", 3) + 2:]
    assert rank_args == job.rank_args == ["train", "c.yaml", "--seed", "1"]
    assert "--nproc-per-node=2" in command and job.per_node == 2
    assert rank_command(command[3:]) == "train"
    assert rank_command(["--nproc-per-node=2", "-m", "longctx_cli", "eval", "c.yaml"]) == "eval"


def test_a_rank_imports_no_command_line_layer_and_prints_a_user_error_once(tmp_path):
    missing = tmp_path / "missing.yaml"
    code = ("import sys, runpy\n"
            f"sys.argv = ['x', 'train', {str(missing)!r}]\n"
            "try:\n"
            "    runpy.run_module('longctx_cli.rank', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, sorted(m for m in ('typer', 'longctx_cli.cli')"
            " if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"RANK": "0", "WORLD_SIZE": "1", "PATH": "/usr/bin"})
    assert proc.stdout.strip().splitlines()[-1] == "exit 2 []", proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1 and str(missing.name) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

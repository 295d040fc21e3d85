"""The `longctx` command line, through Typer's test runner and as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from longctx_cli import __version__
from longctx_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_passkey.yaml"
runner = CliRunner()


def flat(text: str) -> str:
    """Rich wraps at the terminal width; compare text with whitespace collapsed."""
    return " ".join(text.split())


def tiny_with(tmp_path: Path, **overrides) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data.update(overrides)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def longctx(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-c", "from longctx_cli.cli import main; main()", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )


# ---- CliRunner --------------------------------------------------------------------------


def test_validate_prints_the_plan():
    result = runner.invoke(app, ["validate", str(TINY), "--nproc-per-node", "4"])
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "longctx plan" in out
    assert "4 (--nproc-per-node 4 x --nnodes 1)" in out
    assert "data parallel │ 2" in out
    assert "2 (ring: 1 ulysses x 2 ring)" in out
    assert "valid" in out


def test_validate_uses_world_size_from_config(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = runner.invoke(app, ["validate", str(TINY)])
    assert result.exit_code == 0, result.output
    assert "`world_size` in the config" in flat(result.output)


def test_validate_invalid_plan_exits_2(tmp_path):
    path = tiny_with(tmp_path, sequence_parallel_degree=3)
    result = runner.invoke(app, ["validate", str(path), "--nproc-per-node", "4"])
    assert result.exit_code == 2
    out = flat(result.output)
    assert "error: `sequence_parallel_degree` = 3 does not divide the world size 4" in out
    assert "Traceback" not in out


# The examples, GPU ones included, validate offline from a fresh clone:
# tests/test_examples_validate.py.


def test_validate_bad_yaml_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sequence_len: 4096\nseed: [1\n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}:3:1" in flat(result.output)


def test_validate_missing_file_exits_2():
    result = runner.invoke(app, ["validate", "no/such.yaml"])
    assert result.exit_code == 2
    assert "'no/such.yaml' does not exist" in flat(result.output)


def test_validate_rejects_zero_ranks():
    result = runner.invoke(app, ["validate", str(TINY), "--nproc-per-node", "0"])
    assert result.exit_code == 2


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"longctx {__version__}"


@pytest.mark.parametrize("command", [[], ["validate"], ["preprocess"], ["train"], ["eval"]])
def test_help_reads_well(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "Usage: longctx" in out
    assert "Example" in out


def ring_row(tmp_path: Path, drop: tuple[str, ...] = (), **overrides) -> str:
    """The plan's ring and why, for the CPU example with `drop` keys left out."""
    data = yaml.safe_load(TINY.read_text())
    for key in drop:
        data.pop(key)
    data.update(overrides)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["validate", str(path), "--fidelity-probe", "false",
                                 "--output-dir", str(tmp_path / "out")],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {flat(line.split("│")[1]): flat(line.split("│")[2])
            for line in result.output.splitlines() if line.count("│") == 3}
    return f"{rows['ring_attn_func']} ({rows['why this ring']})"


UNNAMED = ("sp_sharding", "heads_k_stride")  # the CPU example names both


@pytest.mark.parametrize(("drop", "overrides", "row"), [
    (UNNAMED, {}, "batch_stripe (the default (ring_attn_func unset): the balanced ring)"),
    # Axolotl's default value, written: still the ring that reads it, and the plan says why.
    (("sp_sharding",), {"heads_k_stride": 1},
     "varlen_llama3 (ring_attn_func unset, not batch_stripe: `heads_k_stride` is given (even "
     "at its default 1): only this ring reads it; leave it out for batch_stripe)"),
    (UNNAMED, {"sequence_parallel_degree": 4, "sequence_parallel_mode": "hybrid",
               "ulysses_degree": 2, "world_size": 4},
     "varlen_llama3 (ring_attn_func unset, not batch_stripe: `sequence_parallel_mode: "
     "hybrid`: a Ulysses group's tokens are not one stripe of the ring)"),
    (("heads_k_stride",), {}, "varlen_llama3 (named by the config's `ring_attn_func` / "
                              "`sp_sharding`)"),
    (UNNAMED, {"ring_attn_func": "batch_zigzag"},
     "batch_zigzag (named by the config's `ring_attn_func` / `sp_sharding`)"),
])
def test_plan_says_why_the_ring_is_what_it_is(tmp_path, drop, overrides, row):
    assert ring_row(tmp_path, drop, **overrides) == row


COMMANDS = ["validate", "preprocess", "train", "eval", "generate", "merge-lora"]


def help_text(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return flat(result.output)


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_flags_show_no_value(command):
    """`--overwrite`, `--force`, `--version` and `--help` take no value: no `<bool>`."""
    assert "<bool>" not in help_text(*command)


def test_each_command_has_its_own_override_example():
    examples = {c: help_text(c).split("overridden after CONFIG, e.g. ")[1].split(" (dashes")[0]
                for c in COMMANDS}
    assert len(set(examples.values())) == len(COMMANDS), examples


@pytest.mark.parametrize(("command", "fallback"), [
    ("validate", "else 1."), ("train", "else 1."),
    ("eval", "else its `sequence_parallel_degree`."),
    ("generate", "else its `sequence_parallel_degree`."),
])
def test_nproc_per_node_help_names_the_real_fallback(command, fallback):
    text = help_text(command)
    assert "Default: torchrun's WORLD_SIZE, else `world_size` in the config, " + fallback in text


def test_help_points_at_what_an_installed_longctx_has():
    """A wheel has no docs/ folder: the help names commands that exist after `pip install`."""
    for command in [[], *[[c] for c in COMMANDS]]:
        assert "docs/" not in help_text(*command)
    assert "python -m longctx_cli.config.docs" in help_text()
    validate = help_text("validate")
    assert "data files" in validate and "fidelity probe" in validate
    assert "Only the model's config is read" not in validate


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "validate" in result.output and "train" in result.output


def test_eval_requires_checkpoint():
    result = runner.invoke(app, ["eval", str(TINY)])
    assert result.exit_code == 2
    assert "--checkpoint" in result.output


def test_preprocess_builds_then_reuses_the_cache(tmp_path):
    path = tiny_with(
        tmp_path,
        output_dir=str(tmp_path / "out"),
        datasets=[{"type": "passkey", "num_samples": 8, "context_lengths": [256]}],
        val_set_size=0.0,
    )
    first = runner.invoke(app, ["preprocess", str(path)])
    assert first.exit_code == 0, first.output
    assert f"cache: {tmp_path / 'out' / 'prepared'}" in flat(first.output)
    second = runner.invoke(app, ["preprocess", str(path)])
    assert second.exit_code == 0, second.output
    assert "Reused" in second.output


# ---- subprocess (the console entry point) ------------------------------------------------


@pytest.mark.slow
def test_subprocess_validate_ok():
    result = longctx("validate", "examples/tiny_passkey.yaml", "--nproc-per-node", "4")
    assert result.returncode == 0, result.stderr
    assert "longctx plan" in result.stdout
    assert "sequence parallel" in result.stdout
    assert "memory per rank" in result.stdout


def test_subprocess_validate_bad_sp(tmp_path):
    path = tiny_with(tmp_path, sequence_parallel_degree=3)
    result = longctx("validate", str(path), "--nproc-per-node", "4")
    assert result.returncode == 2
    assert "sequence_parallel_degree" in result.stderr
    assert flat(result.stderr).startswith("error: `sequence_parallel_degree` = 3")
    assert "Traceback" not in result.stdout + result.stderr




def test_subprocess_usage_error_has_no_traceback():
    result = longctx("validate")
    assert result.returncode == 2
    assert "Missing argument" in result.stderr
    assert "Traceback" not in result.stderr


def test_rank_threads_share_the_cores_and_warn_when_a_user_value_oversubscribes():
    from longctx_cli.launcher.launch import rank_threads

    assert rank_threads(None, 2, 8) == ("4", None)
    assert rank_threads("", 4, 2) == ("1", None)  # never 0 threads
    assert rank_threads("1", 2, 2) == ("1", None)
    threads, warning = rank_threads("2", 2, 2)
    assert threads == "2"  # the user's value is kept ...
    assert warning is not None  # ... and the oversubscription is named, with the fix
    assert "OMP_NUM_THREADS=2" in warning and "4 compute threads on 2 cores" in warning
    assert "OMP_NUM_THREADS=1" in warning
    assert rank_threads("many", 2, 2) == ("many", None)

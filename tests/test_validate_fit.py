"""`longctx validate` judges the fit whenever the target's memory per rank is known (issue 71):
from `--memory-per-rank`, the config's `memory_per_rank` (Axolotl's `gpu_memory_limit`) or
the local GPUs. A plan that does not fit is one paragraph, exit 2, naming the parts that
dominate and fixes that fit, each validated here when taken; with no target the last line
says the fit was not judged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from longctx_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
EIGHT_B = ROOT / "examples" / "llama3-8b-lora-64k.yaml"
TINY = ROOT / "examples" / "tiny_passkey.yaml"
runner = CliRunner(env={"COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
NO_PROBE = ("--fidelity-probe", "false")  # the probe is not what is tested


def validate(path: Path, *args: str) -> tuple[int, str, list[str]]:
    result = runner.invoke(app, ["validate", str(path), *args, *NO_PROBE])
    return result.exit_code, " ".join(result.output.split()), result.output.splitlines()


@pytest.fixture(autouse=True)
def _in_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the checkout


def offered_fixes(out: str) -> list[str]:
    """The `key: value` of each fix the paragraph offers."""
    fixes = out.split("Fix: any of:", 1)[1]
    return re.findall(r"`(\w+: \w+)`", fixes)


def test_a_plan_over_the_configs_memory_is_refused_with_fixes_that_fit() -> None:
    # The 8B example is written for 80 GB GPUs (`memory_per_rank: 80GB`); without
    # checkpointing its plan needs more.
    code, out, _ = validate(EIGHT_B, "--gradient-checkpointing", "false")
    assert code == 2, out
    assert "the plan needs about 109.6 GiB per rank (98.7 GiB estimated + 1 GiB" in out
    assert "more than the 74.5 GiB of `memory_per_rank: 80GB`" in out
    assert "most of it is activations (saved) 81.5 GiB, parameters 15.1 GiB" in out
    assert "valid" not in out.replace("invalid", "").split("error:")[1]
    fixes = offered_fixes(out)
    assert "gradient_checkpointing: true" in fixes and any(
        f.startswith("sequence_len: ") for f in fixes), out
    for fix in fixes:
        key, value = fix.split(": ")
        overrides = {"gradient_checkpointing": "false", key: value}
        args = [a for k, v in overrides.items() for a in (f"--{k.replace('_', '-')}", v)]
        code, taken, lines = validate(EIGHT_B, *args)
        assert code == 0 and lines[-1].strip() == "valid", (fix, taken)
        assert " fit: " in f" {taken}", taken


def test_a_plan_that_needs_more_ranks_than_the_launch_is_an_error() -> None:
    code, out, _ = validate(EIGHT_B, "--gradient-checkpointing", "false", "--chunked-loss",
                            "false", "--memory-per-rank", "80GiB")
    assert code == 2, out
    assert "more than the 8 ranks of this launch" in out  # what the degrees say
    assert "more than the 80.0 GiB of --memory-per-rank 80GiB" in out
    # The smallest sp that fits *this launch* is offered only where one does: here none.
    assert "`sequence_parallel_degree: 16`" not in out


def test_axolotls_gpu_memory_limit_is_the_target(tmp_path: Path) -> None:
    code, out, _ = validate(EIGHT_B, "--memory-per-rank", "80GiB")
    assert code == 0 and "fit: 23.5 GiB per rank" in out, out
    code, out, _ = validate(EIGHT_B, "--memory-per-rank", "20GiB")
    assert code == 2 and "more than the 20.0 GiB of --memory-per-rank 20GiB" in out, out
    config = tmp_path / "axolotl.yaml"
    config.write_text(EIGHT_B.read_text().replace("memory_per_rank: 80GB", "gpu_memory_limit: 20"))
    code, out, _ = validate(config)
    assert code == 2, out
    assert "more than the 20.0 GiB of `gpu_memory_limit: 20`" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here is the target")
def test_without_a_target_the_last_line_says_the_fit_was_not_judged() -> None:
    code, out, lines = validate(TINY)
    assert code == 0, out
    assert lines[-2].strip() == "valid"
    assert lines[-1].startswith("fit not judged: no target memory per rank"), lines[-1]

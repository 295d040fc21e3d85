"""Every fix `longctx validate` offers is checked against every rule before it is printed, and
all of a config's plan-level problems come in one report (issue 71): each case through the
real CLI, its exit code, its paragraph, and each value offered validated when taken."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longctx_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_passkey.yaml"
QWEN = ROOT / "examples" / "qwen2.5-7b-128k-2nodes.yaml"
runner = CliRunner(env={"COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
NO_PROBE = ("--fidelity-probe", "false")  # the probe is not what is tested


def validate(path: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["validate", str(path), *args, *NO_PROBE])
    return result.exit_code, " ".join(result.output.split())


def offered(out: str, key: str) -> list[str]:
    """The values a fix offers for `key` ("set `key` to 1, 2 or 4")."""
    found = re.search(rf"`{key}` to ([\w, ]+?)(?: \(|;|\.)", out)
    assert found, out
    return re.split(r", | or ", found.group(1))


@pytest.fixture(autouse=True)
def _in_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the checkout


def test_sp_that_does_not_divide_the_ranks_offers_only_degrees_that_pass() -> None:
    code, out = validate(TINY, "--nproc-per-node", "3")
    assert code == 2, out
    assert "`sequence_parallel_degree` = 2 does not divide the world size 3" in out
    # 3 divides the ranks but not zigzag's 2 x 3 chunks of 2048 tokens: not offered.
    assert offered(out, "sequence_parallel_degree") == ["1"], out
    assert "or launch a multiple of 2 ranks" in out
    assert validate(TINY, "--nproc-per-node", "3", "--sequence-parallel-degree", "1")[0] == 0
    assert validate(TINY, "--nproc-per-node", "4")[0] == 0  # the launch offered


def test_ulysses_degrees_offered_give_every_rank_a_head() -> None:
    args = ("--nproc-per-node", "16", "--sequence-parallel-mode", "ulysses")
    code, out = validate(TINY, *args, "--sequence-parallel-degree", "16")
    assert code == 2, out
    assert "num_attention_heads = 8 is fewer than the Ulysses group size 16" in out
    values = offered(out, "sequence_parallel_degree")
    assert values == ["1", "2", "4", "8"], out
    for sp in values:
        code, taken = validate(TINY, *args, "--sequence-parallel-degree", sp)
        assert code == 0, taken


def test_uneven_ulysses_heads_validate_and_show_their_split() -> None:
    """Qwen2.5-7B's 28 heads / 4 KV heads over 16 Ulysses ranks: a replicated KV head's 7
    query heads split 2, 2, 2, 1 over its 4 ranks."""
    args = ("--sequence-parallel-mode", "ulysses", "--ulysses-degree", "null")
    code, out = validate(QWEN, *args)
    assert code == 0, out
    assert "ulysses heads │ 2, 2, 2, 1, 2, 2, 2, 1," in out
    assert "the largest 1.14x the mean" in out


def test_a_kernel_refused_offers_only_kernels_that_run_here_and_on_the_target() -> None:
    code, out = validate(TINY, "--attention-kernel", "flash")
    assert code == 2, out
    assert "not supported by `attention_kernel: flash`" in out
    kernels = offered(out, "attention_kernel")
    assert "flash" not in kernels and "auto" in kernels, out
    for kernel in kernels:
        code, taken = validate(TINY, "--attention-kernel", kernel)
        assert code == 0, (kernel, taken)


def test_all_plan_problems_come_in_one_report_and_their_fixes_validate() -> None:
    code, out = validate(TINY, "--nproc-per-node", "3", "--attention-kernel", "flash")
    assert code == 2, out
    assert out.startswith("error: 2 problems in the plan"), out
    assert "does not divide the world size 3" in out and "`attention_kernel: flash`" in out
    sp, kernel = offered(out, "sequence_parallel_degree")[0], offered(out, "attention_kernel")[0]
    code, taken = validate(TINY, "--nproc-per-node", "3", "--sequence-parallel-degree", sp,
                           "--attention-kernel", kernel)
    assert code == 0, taken

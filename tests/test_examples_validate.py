"""Every example validates from a fresh clone, offline: `longctx validate examples/X.yaml`
run in a copy of what git would check out of examples/ (so no file another test or an
earlier run left there can make it pass), the way a newcomer runs it: from the clone's root,
bare and with the flags the example's own header shows."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app
from tests.train_helpers import write_quickstart_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
# `#   longctx validate examples/x.yaml --nproc-per-node 8` in an example's header comment.
SHOWN_VALIDATE = re.compile(r"^#\s+longctx (validate .*)$", re.MULTILINE)


def example_files() -> list[str]:
    """examples/ as a clone has it: tracked files and new ones not yet committed, never
    ignored ones (outputs, caches). Without git (an unpacked sdist): the whole folder."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "examples"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return [str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*") if p.is_file()]
    return [name for name in listed if name and (ROOT / name).is_file()]


def _copy_examples(root: Path) -> Path:
    for name in example_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    return root


@pytest.fixture(scope="module")
def bare_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/ as a fresh clone has it, before anything ran."""
    return _copy_examples(tmp_path_factory.mktemp("bare-clone"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _copy_examples(tmp_path_factory.mktemp("fresh-clone"))
    write_quickstart_model(root)  # after the Quickstart: tiny_grpo.yaml starts from its model
    for example in EXAMPLES:  # the data scripts an example's first line asks for
        script = generated_by(example)
        if script:
            subprocess.run([sys.executable, *shlex.split(script)], cwd=root, check=True,
                           capture_output=True, timeout=300)
    return root


# `# First run `python examples/x.py ...`: ...` on an example's first line.
FIRST_RUN = re.compile(r"^# First run `python (examples/\S+\.py[^`]*)`")


def generated_by(example: str) -> str | None:
    """The script (and its arguments) an example's first line says to run before it."""
    found = FIRST_RUN.match((ROOT / "examples" / example).read_text())
    return found.group(1) if found else None


@pytest.mark.parametrize("example", [e for e in EXAMPLES if generated_by(e)])
def test_an_example_whose_data_a_script_writes_says_so(
        example: str, bare_clone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its script ran, such an example's `validate` exits 2 naming the missing file,
    and the README names the example among those that need something first."""
    monkeypatch.chdir(bare_clone)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["validate", f"examples/{example}"])
    assert result.exit_code == 2, result.output
    assert "does not exist" in result.output or "no such" in result.output, result.output
    assert f"`{example}`" in (ROOT / "README.md").read_text().split("## Examples")[1]


def needs_a_run_first(example: str) -> bool:
    """An example that starts from a model an earlier run writes (`base_model: outputs/...`)."""
    base = yaml.safe_load((ROOT / "examples" / example).read_text()).get("base_model")
    return str(base or "").startswith("outputs/")


@pytest.mark.parametrize("example", [e for e in EXAMPLES if needs_a_run_first(e)])
def test_an_example_that_needs_a_run_first_says_so(
        example: str, bare_clone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clone where nothing has run yet, an example that starts from an earlier run's
    model (every other example validates there: the test above gives only this kind what
    it starts from): its first line says which run comes before it, `validate` exits 2
    naming what is missing, and the README says the same of it."""
    monkeypatch.chdir(bare_clone)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["validate", f"examples/{example}"])
    first = (ROOT / "examples" / example).read_text().splitlines()[0]
    assert first.startswith("# Run after"), f"{example}'s first line: {first}"
    assert result.exit_code == 2, result.output
    assert "no such folder" in result.output, result.output
    readme = (ROOT / "README.md").read_text()
    assert f"except `{example}`" in readme, f"the README should name {example}"


def validate_commands(example: str) -> list[list[str]]:
    """The bare command, then each `longctx validate` line the example's header shows."""
    commands = [["validate", f"examples/{example}"]]
    for line in SHOWN_VALIDATE.findall((ROOT / "examples" / example).read_text()):
        shown = shlex.split(line)
        if shown not in commands:
            commands.append(shown)
    return commands


def test_every_example_is_found() -> None:
    # The three GPU examples need hub models and data files; the tiny ones run anywhere.
    assert {"llama3-8b-lora-64k.yaml", "qwen2.5-7b-128k-2nodes.yaml",
            "llama3.1-70b-tp8-sp4-fsdp.yaml", "tiny_passkey.yaml"} <= set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_validates_from_a_fresh_clone(example: str, clone: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(clone)  # dataset paths are relative to where longctx runs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline whatever the network
    monkeypatch.setenv("COLUMNS", "200")
    for command in validate_commands(example):
        result = CliRunner().invoke(app, command)
        shown = "longctx " + " ".join(command)
        assert result.exit_code == 0, f"{shown}\n{result.output}"
        # (library warnings printed after it land in the same output)
        assert "valid" in [line.strip() for line in result.output.splitlines()], \
            f"{shown}\n{result.output}"
        base = yaml.safe_load((clone / "examples" / example).read_text()).get("base_model")
        if base and not (clone / base).exists():
            # No download: the shape of a hub model comes from the built-in table, and the
            # plan says so.
            assert "built-in table" in result.output, f"{shown}\n{result.output}"

"""`longctx validate` never ignores an unknown key silently (issue 71): a typo, a key of no
tool longctx knows, and a mistyped command-line flag are each one paragraph and exit 2; the
fix each offers validates when taken; `strict: false` is the one way to have unknown keys
listed as ignored."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_passkey.yaml"
runner = CliRunner(env={"COLUMNS": "250"})  # rich wraps no table row


def flat(text: str) -> str:
    return " ".join(text.split())


def config(tmp_path: Path, **keys: object) -> Path:
    """The bundled example with `keys` added (the probe off: it is not what is tested)."""
    data = {**yaml.safe_load(TINY.read_text()), "fidelity_probe": False,
            "output_dir": str(tmp_path / "out"), **keys}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def validate(path: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["validate", str(path), *args])
    return result.exit_code, flat(result.output)


def test_a_key_cut_short_is_a_typo_and_its_fix_validates(tmp_path: Path) -> None:
    code, out = validate(config(tmp_path, gradient_checkpoint=True))
    assert code == 2, out
    assert "unknown key `gradient_checkpoint`; did you mean `gradient_checkpointing`?" in out
    assert "Traceback" not in out and "valid" not in out.replace("invalid", "")
    # Even a config that asks for leniency: a typo of a known key is never ignored.
    code, out = validate(config(tmp_path, strict=False, gradient_checkpoint=True))
    assert code == 2 and "did you mean `gradient_checkpointing`?" in out, out
    code, out = validate(config(tmp_path, gradient_checkpointing=True))
    assert code == 0 and "fit not judged" in out.split(" valid ")[-1], out


def test_an_unknown_key_is_an_error_naming_the_nearest_keys_and_strict_false(
        tmp_path: Path) -> None:
    code, out = validate(config(tmp_path, micro_batchsize_per_gpu=2))
    assert code == 2, out
    assert ("unknown key `micro_batchsize_per_gpu`: neither a longctx key nor one of the "
            "Axolotl keys docs/axolotl.md lists; the nearest known keys are "
            "`micro_batch_size`") in out
    assert "set `strict: false` to have unknown keys listed in the plan as ignored" in out
    assert out.count("Fix:") == 1  # one paragraph
    code, out = validate(config(tmp_path, micro_batch_size=2))
    assert code == 0, out
    # Asked for explicitly, leniency lists the key, with what it means.
    code, out = validate(config(tmp_path, strict=False, micro_batchsize_per_gpu=2))
    assert code == 0, out
    assert "micro_batchsize_per_gpu │ ignored (`strict: false`): not a key longctx knows" in out


def test_axolotl_keys_ignored_on_purpose_stay_listed_with_their_reasons(tmp_path: Path) -> None:
    code, out = validate(config(tmp_path, low_cpu_mem_usage=True))
    assert code == 0, out
    assert "low_cpu_mem_usage │ ignored:" in out and "not a key longctx knows" not in out


def test_a_mistyped_flag_is_never_read_as_a_config_key(tmp_path: Path) -> None:
    path = config(tmp_path)
    code, out = validate(path, "--nproc", "2")
    assert code == 2, out
    assert ("`--nproc` is neither an option of this command nor a config key; did you mean "
            "`--nproc-per-node` (an option)") in out
    assert "axolotl keys" not in out
    code, out = validate(path, "--nproc-per-node", "2")
    assert code == 0, out
    # Even under `strict: false`: the command line holds no other tool's keys.
    code, out = validate(config(tmp_path, strict=False), "--nproc", "2")
    assert code == 2 and "`--nproc` is neither an option" in out, out


def test_a_dataset_entry_key_of_no_tool_is_an_error(tmp_path: Path) -> None:
    entry = {"path": str(tmp_path / "d.jsonl"), "type": "completion", "team_note": "x"}
    (tmp_path / "d.jsonl").write_text('{"text": "one record"}\n')
    code, out = validate(config(tmp_path, datasets=[entry]))
    assert code == 2, out
    assert "unknown key `datasets[0].team_note`" in out and "strict: false" in out

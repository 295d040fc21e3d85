"""One view of the target in `longctx validate` (issue 71): on a machine without CUDA every GPU
kernel is planned for the run's GPUs with an "assumed" row (none refused for this machine),
the kernel row of `auto` names what the ranks run on the GPUs, and the small slips the issue
names: the model type of a text model given `processor_type`, held-out eval rows that are
never evaluated, and the preprocess report under `sample_packing_sequentially`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
EIGHT_B = ROOT / "examples" / "llama3-8b-lora-64k.yaml"
TINY = ROOT / "examples" / "tiny_passkey.yaml"
runner = CliRunner(env={"COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
NO_PROBE = ("--fidelity-probe", "false")  # the probe is not what is tested
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(autouse=True)
def _in_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the checkout


@no_cuda
@pytest.mark.parametrize("kernel", ["flash", "torch_flash", "cudnn", "fa4"])
def test_every_gpu_kernel_is_planned_for_the_gpus_with_an_assumed_row(kernel: str) -> None:
    code, out = run("validate", str(EIGHT_B), "--attention-kernel", kernel, *NO_PROBE)
    assert code == 0, out
    assert f"attention kernel │ {kernel} (requested" in out
    assert "assumed │ this machine has no CUDA GPU; the plan assumes the run's machines have" in out
    assert "cannot run" not in out


@no_cuda
def test_the_kernel_row_of_auto_names_what_the_ranks_run_on_the_gpus() -> None:
    code, out = run("validate", str(EIGHT_B), *NO_PROBE)
    assert code == 0, out
    assert ("attention kernel │ torch (auto: no CUDA GPU); on the run's CUDA GPUs the ranks run "
            "torch_flash") in out


def test_processor_type_on_a_text_model_names_its_model_type(tmp_path: Path) -> None:
    code, out = run("validate", str(TINY), "--processor-type", "AutoProcessor", *NO_PROBE)
    assert code == 2, out
    assert "has no vision tower (model type `llama`)" in out and "`?`" not in out


def test_held_out_rows_that_are_never_evaluated_are_said_so() -> None:
    code, out = run("validate", str(EIGHT_B), *NO_PROBE)
    assert code == 0, out
    assert ("eval loss │ none: `val_set_size: 0.01` (rows held out of training) is never "
            "evaluated; set `eval_steps` or `evals_per_epoch` to evaluate it") in out
    code, out = run("validate", str(EIGHT_B), "--eval-steps", "100", *NO_PROBE)
    assert code == 0 and "eval loss │ every 100 steps" in out, out


def test_the_preprocess_report_names_sequential_packing(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n"
                            for i in range(20)))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 384},
        "tokenizer": "byte", "sequence_len": 128, "sample_packing": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "output_dir": str(tmp_path / "out")}))
    code, out = run("preprocess", str(config), "--sample-packing-sequentially", "true")
    assert code == 0, out
    assert "packed in order (sequential)" in out and "FFD" not in out
    code, out = run("preprocess", str(config))
    assert code == 0 and "packed (FFD)" in out, out


def test_an_audio_processor_is_refused_as_audio(tmp_path: Path) -> None:
    """Voxtral's processor reads audio: the refusal says so, not "no vision tower"."""
    from transformers import VoxtralConfig

    folder = tmp_path / "voxtral"
    VoxtralConfig().save_pretrained(folder)
    config = yaml.safe_load(TINY.read_text())
    config.pop("model_config", None)
    config.update(base_model=str(folder), processor_type="VoxtralProcessor")
    path = tmp_path / "audio.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = run("validate", str(path), *NO_PROBE)
    out = " ".join(out.split())
    assert code == 2, out
    assert "`processor_type: VoxtralProcessor` reads audio records" in out, out
    assert "model type `voxtral`" in out and "no vision tower" not in out

"""Axolotl training keys really act: QLoRA (4-bit base) parity across SP layouts, the issue's
sequence-parallel example at sp=4 through overrides, wandb offline files, the loss watchdog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.train_helpers import (
    TINY_LLAMA,
    assert_same_run,
    read_metrics,
    run_longctx,
    train,
    write_config,
    write_documents,
)

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_documents(tmp_path_factory.mktemp("data") / "docs.jsonl")


@pytest.mark.slow  # QLoRA under SP stays by default in tests/test_fsdp_qlora.py
def test_qlora_4bit_base_parity_sp1_sp2_ulysses(tmp_path, data_file):
    common = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8,
              "lora_target_linear": True, "max_steps": 3, "eval_steps": 3,
              "bnb_config_kwargs": {"bnb_4bit_use_double_quant": False}}
    ref = write_config(tmp_path, "sp1", data_file, **common)
    sp2 = write_config(tmp_path, "sp2", data_file, **common, sequence_parallel_degree=2)
    uly = write_config(tmp_path, "uly", data_file, **common, sequence_parallel_degree=2,
                       sequence_parallel_mode="ulysses")
    train(ref, 1)
    train(sp2, 2)
    train(uly, 2)
    for run in ("sp2", "uly"):
        assert_same_run(tmp_path / run, tmp_path / "sp1", adapter=True, tol=1e-4)
    adapter = json.loads((tmp_path / "sp1" / "final" / "adapter_config.json").read_text())
    targets = adapter["target_modules"]  # lora_target_linear: every linear layer
    assert any(t.endswith("q_proj") for t in targets)
    assert any(t.endswith("down_proj") for t in targets)


AXOLOTL_CONFIGS = Path(__file__).resolve().parent / "axolotl_configs"


@pytest.mark.slow
def test_issue_example_trains_at_sp4_with_a_tiny_model_override(tmp_path):
    """The Axolotl SP example, unchanged, with a tiny local model swapped in by overrides."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tiny = tmp_path / "tiny"
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**fields)).save_pretrained(tiny)
    out = tmp_path / "out"
    result = run_longctx(
        "train", str(AXOLOTL_CONFIGS / "issue_sp4.yaml"), "--nproc-per-node", "4",
        "--base-model", str(tiny), "--tokenizer", "byte", "--dtype", "float32",
        "--sequence-len", "256", "--max-steps", "2", "--learning-rate", "1e-3",
        "--datasets", "[{type: passkey, num_samples: 8}]",
        "--output-dir", str(out), "--dataset-prepared-path", str(tmp_path / "prepared"),
        "--collective-timeout-s", "120",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["loss"] > 0 and m["tokens"] > 0 for m in metrics)
    assert (out / "final" / "model.safetensors").is_file()
    saved = yaml.safe_load((AXOLOTL_CONFIGS / "issue_sp4.yaml").read_text())
    assert saved["sequence_parallel_degree"] == 4  # the file itself is unchanged


@pytest.mark.slow
def test_wandb_offline_cadence_and_8bit_optimizer(tmp_path, data_file):
    """wandb (the real library, offline) gets the run; fractional save/eval steps, warmup_ratio
    and a bitsandbytes optimizer act."""
    pytest.importorskip("wandb")
    path = write_config(
        tmp_path, "wb", data_file, max_steps=4, save_steps=0.5, eval_steps=0.5,
        warmup_steps=None, warmup_ratio=0.25, lr_scheduler="linear", optimizer="adamw_8bit",
        wandb_project="longctx-test", wandb_name="axo", wandb_log_model="end",
        loss_watchdog_threshold=1000.0,
    )
    result = run_longctx("train", str(path), "--nproc-per-node", "1",
                         env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "wb"
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [("eval_loss" in m) for m in metrics] == [False, True, False, True]
    assert metrics[0]["lr"] == 0.0 and metrics[1]["lr"] == pytest.approx(0.01)  # 1 warm-up step
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log,) = runs[0].glob("run-*.wandb")  # the run's record log (protobuf records)
    records = log.read_bytes()
    for text in (b"longctx-test", b"axo", b"eval_loss", b"grad_norm", b"tokens_per_sec"):
        assert text in records, text  # project, run name, the logged metrics
    assert b"final" in records  # wandb_log_model: end -> the final model as an artifact


@pytest.mark.slow
def test_loss_watchdog_stops_the_run(tmp_path, data_file):
    path = write_config(tmp_path, "dog", data_file, max_steps=5,
                        loss_watchdog_threshold=0.01, loss_watchdog_patience=2)
    result = run_longctx("train", str(path), "--nproc-per-node", "1")
    assert result.returncode == 2
    assert "loss_watchdog_threshold" in result.stderr and "Traceback" not in result.stderr
    metrics = read_metrics(tmp_path / "dog")
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["stopped"] == "loss_watchdog"

"""Shared pieces of the end-to-end training tests: configs, data, running `longctx train`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

# What a test's sitecustomize fault checks before it applies: this process runs a rank
# (torchrun set RANK) or will run one (a warm process, started with `--warm` ahead of it,
# learns its RANK at the hand-over, so rank-specific faults read RANK at call time).
IN_A_RANK = "('RANK' in os.environ or sys.argv[1:2] == ['--warm'])"

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 1024,
}


def write_documents(path: Path, count: int = 64, seed: int = 0) -> Path:
    """Completion documents of very different lengths, so packed rows mix short and long ones
    and document boundaries fall everywhere relative to rank boundaries."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with path.open("w") as f:
        for i in range(count):
            n = rng.choice([1, 2, 3, 8, 15, 20, 25])
            text = " ".join(rng.choice(words) for _ in range(n))
            f.write(json.dumps({"text": f"{i}: {text}"}) + "\n")
    return path


def write_config(tmp_path: Path, name: str, data_file: Path, **overrides) -> Path:
    config = {
        "model_config": TINY_LLAMA,
        "tokenizer": "byte",
        "dtype": "float32",
        "datasets": [{"path": str(data_file), "type": "completion", "field": "text"}],
        "sequence_len": 128,
        "sample_packing": True,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "attention_kernel": "torch",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "max_steps": 5,
        "learning_rate": 0.01,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "seed": 7,
        "output_dir": str(tmp_path / name),
        "logging_steps": 1,
        "val_set_size": 4,
        "eval_steps": 5,
        "collective_timeout_s": 60,
    }
    config.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_longctx(
    *args: str, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "longctx_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def train(config_path: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    result = run_longctx("train", str(config_path), "--nproc-per-node", str(nproc), *extra)
    output = f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"train failed:\n{output}"
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def final_tensors(output_dir: Path, adapter: bool = False) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if adapter else "model.safetensors"
    return load_file(str(output_dir / "final" / name))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_same_run(run: Path, reference: Path, adapter: bool = False, tol: float = 1e-5,
                    weight_tol: float | None = None) -> None:
    """Per-step losses equal within `tol` relative, final weights within `weight_tol` (default
    `tol`)."""
    got, want = read_metrics(run), read_metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"], (g, w)
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (g, w)
        assert ("eval_loss" in g) == ("eval_loss" in w), (g, w)
        if "eval_loss" in w:
            assert abs(g["eval_loss"] - w["eval_loss"]) <= tol * abs(w["eval_loss"]), (g, w)
    got_w, want_w = final_tensors(run, adapter), final_tensors(reference, adapter)
    assert got_w.keys() == want_w.keys()
    for key in want_w:
        error = relative_error(got_w[key], want_w[key])
        assert error <= (tol if weight_tol is None else weight_tol), (key, error)


def write_quickstart_model(root: Path) -> Path:
    """The config of the model the Quickstart's run leaves in `outputs/tiny_passkey/final`
    (under `root`), which examples/tiny_grpo.yaml starts from: what `validate` reads."""
    from transformers import AutoConfig

    examples = Path(__file__).resolve().parents[1] / "examples"
    fields = yaml.safe_load((examples / "tiny_passkey.yaml").read_text())["model_config"]
    folder = root / "outputs" / "tiny_passkey" / "final"
    AutoConfig.for_model(**fields).save_pretrained(folder)
    return folder

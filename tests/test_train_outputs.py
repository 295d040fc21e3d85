"""Resume continues exactly; final/ loads with plain transformers / peft; failures end the job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train_helpers import (
    IN_A_RANK,
    assert_same_run,
    read_metrics,
    run_longctx,
    train,
    write_config,
    write_documents,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs")
    return path, write_documents(path / "docs.jsonl", seed=1)


@pytest.mark.slow  # the preemption and restart tests resume and compare too
def test_resume_equals_uninterrupted_run(workdir):
    path, data = workdir
    common = {"sequence_parallel_degree": 2, "gradient_accumulation_steps": 2, "save_steps": 3}
    straight = write_config(path, "straight", data, max_steps=6, **common)
    train(straight, 2)

    first_half = write_config(path, "resumed", data, max_steps=3, **common)
    train(first_half, 2)
    assert (path / "resumed" / "checkpoint-3" / "COMPLETE").is_file()
    second_half = write_config(
        path, "resumed", data, max_steps=6, resume_from_checkpoint="auto", **common
    )
    result = train(second_half, 2)
    assert "resumed from" in result.stdout + result.stderr
    assert_same_run(path / "resumed", path / "straight", tol=1e-6)


_PLAIN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
final, adapter = sys.argv[1], sys.argv[2] == "1"
ids = torch.tensor([json.loads(sys.argv[3])])
if adapter:
    from peft import PeftConfig, PeftModel
    base_path = PeftConfig.from_pretrained(final).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path)
    model = PeftModel.from_pretrained(base, final)
else:
    model = AutoModelForCausalLM.from_pretrained(final)
assert "longctx_cli" not in sys.modules
with torch.no_grad():
    torch.save(model(input_ids=ids).logits[0], sys.argv[4])
"""


def _plain_logits(final: Path, adapter: bool, ids: list[int], out: Path) -> torch.Tensor:
    subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, str(final), "1" if adapter else "0",
         json.dumps(ids), str(out)],
        check=True, timeout=120,
    )
    return torch.load(out, weights_only=True)


def _longctx_logits(config_path: Path, final: Path, adapter: bool, ids: list[int]) -> torch.Tensor:
    """Logits of the exported weights through longctx's own SP attention path (sp=1)."""
    from safetensors.torch import load_file

    from longctx_cli.config import load_config
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.model import build_model
    from tests.layouts import rank_state

    config = load_config(config_path)
    model = build_model(config)
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    state = load_file(str(final / weights))
    if adapter:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        model.load_state_dict(state, strict=False)
    model.eval()
    n = len(ids)
    batch = shard_batch(
        torch.tensor(ids), torch.arange(n), torch.tensor(ids), rank_state()
    )
    with torch.no_grad():
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                     sp_meta=batch.sp_meta).logits[0]


@pytest.mark.parametrize("adapter", [pytest.param(False, marks=pytest.mark.slow), True])
def test_final_loads_with_plain_transformers(workdir, adapter):
    path, data = workdir
    name = "export_lora" if adapter else "export_full"
    extra = {"adapter": "lora", "lora_r": 4, "learning_rate": 0.05} if adapter else {}
    cfg = write_config(path, name, data, sequence_parallel_degree=2, max_steps=2, **extra)
    train(cfg, 2)
    final = path / name / "final"
    assert (final / "tokenizer_config.json").is_file()
    ids = list(range(3, 60))
    plain = _plain_logits(final, adapter, ids, path / f"{name}_logits.pt")
    ours = _longctx_logits(cfg, final, adapter, ids)
    assert plain.shape == (len(ids), 384)
    rel = float((plain - ours).norm() / ours.norm())
    assert rel < 1e-5, rel


def test_output_dir_of_another_run_is_protected(workdir):
    path, data = workdir
    cfg = write_config(path, "protected", data, max_steps=1)
    train(cfg, 1)
    before = (path / "protected" / "metrics.jsonl").read_text()
    again = run_longctx("train", str(cfg), "--nproc-per-node", "1")
    assert again.returncode == 2
    assert "already holds another run" in again.stderr
    assert "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert (path / "protected" / "metrics.jsonl").read_text() == before
    train(cfg, 1, "--overwrite")


def test_failing_rank_ends_the_job_quickly(workdir, tmp_path):
    """A rank that raises mid-run takes the whole job down, non-zero, without hanging."""
    path, data = workdir
    cfg = write_config(path, "failing", data, sequence_parallel_degree=2, max_steps=50)
    plugin = tmp_path / "sitecustomize.py"
    # Test-only fault: rank 1 raises inside its 3rd optimizer step.
    plugin.write_text(
        # (A warm rank process learns its RANK at the hand-over: checked at call time.)
        "import os, sys\n"
        f"if {IN_A_RANK}:\n"
        "    import torch\n"
        "    _step = torch.optim.AdamW.step\n"
        "    calls = [0]\n"
        "    def step(self, *a, **k):\n"
        "        calls[0] += 1\n"
        "        if calls[0] == 3 and os.environ.get('RANK') == '1':\n"
        "            raise RuntimeError('injected failure on rank 1')\n"
        "        return _step(self, *a, **k)\n"
        "    torch.optim.AdamW.step = step\n"
    )
    started = time.monotonic()
    result = run_longctx(
        "train", str(cfg), "--nproc-per-node", "2", env={"PYTHONPATH": str(tmp_path)},
        timeout=180,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stdout + result.stderr
    assert elapsed < 120
    # Rank 0 may log step 3 before the agent stops it: its collectives precede the step.
    metrics = read_metrics(path / "failing")
    assert len(metrics) in (2, 3)

"""FSDP-QLoRA: LoRA on a bitsandbytes 4-bit base whose packed weights FSDP2 shards (CPU, gloo).

FSDP2 shards each packed 4-bit weight (a uint8 `[n, 1]` tensor) along its first dimension and
gathers it back byte for byte; bitsandbytes reads the gathered bytes with the quantization
state kept on the module (`runtime/model.py:keep_4bit_state_on_modules`). So a sharded layer
computes bit for bit what the unsharded one does, a run with FSDP under SP equals the
single-process QLoRA run up to float32 summation order, and `validate` shows what a rank holds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.distributed import run_distributed
from tests.train_helpers import (
    TINY_LLAMA,
    assert_same_run,
    final_tensors,
    read_metrics,
    relative_error,
    train,
    write_config,
    write_documents,
)

pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parents[1]

# Double quantization (the default) is on: its second-level state must survive sharding too.
QLORA = {"adapter": "qlora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True,
         "max_steps": 3, "eval_steps": 3}


# ---- one sharded model, in process ------------------------------------------------------


def _quantized(path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=quant, device_map={"": "cpu"},
        attn_implementation="sdpa")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _sharded_step_worker(rank: int, world: int, path: str) -> dict:
    from bitsandbytes.nn import Linear4bit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from longctx_cli.runtime.model import apply_fsdp, keep_4bit_state_on_modules

    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 48),
                        generator=torch.Generator().manual_seed(3))
    plain, sharded = _quantized(path), _quantized(path)
    bytes_before = {n: m.weight.detach().clone() for n, m in sharded.named_modules()
                    if isinstance(m, Linear4bit)}
    layers = keep_4bit_state_on_modules(sharded)
    apply_fsdp(sharded, init_device_mesh("cpu", (world,)))
    losses, grads = [], []
    for model in (plain, sharded):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                      for n, p in model.named_parameters() if p.requires_grad})
    same_bytes = []
    for name, module in sharded.named_modules():
        if isinstance(module, Linear4bit):
            weight = module.weight
            assert isinstance(weight, DTensor) and weight.dtype == torch.uint8, name
            assert weight.to_local().shape[0] * world == weight.shape[0], name
            # Gathered again, the packed bytes are the quantized ones exactly.
            same_bytes.append(torch.equal(weight.full_tensor(), bytes_before[name]))
    # Plain values only: tensors sent back through the queue may outlive their sender.
    return {"layers": layers, "same_bytes": same_bytes,
            "losses": [float(x) for x in losses], "same_loss": torch.equal(*losses),
            "grads": sorted(grads[0]) == sorted(grads[1]) and len(grads[0]),
            "grads_differ": [n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])]}


@pytest.mark.slow
def test_sharded_4bit_layers_compute_bit_for_bit(tmp_path):
    """Both ranks hold half of every packed weight; the step's loss and every LoRA gradient
    equal the unsharded model's exactly (both ranks see the same row, and FSDP2's average of
    two equal float32 gradients is that gradient)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**fields)).save_pretrained(tmp_path / "base")
    for result in run_distributed(_sharded_step_worker, 2, str(tmp_path / "base"),
                                  timeout_s=180):
        layers = 7 * TINY_LLAMA["num_hidden_layers"]
        assert result["layers"] == layers
        assert result["same_bytes"] == [True] * layers
        assert result["same_loss"], result["losses"]
        assert result["grads"] == 2 * layers  # lora_A and lora_B of every 4-bit layer
        assert result["grads_differ"] == []


# ---- training runs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp_qlora")
    return path, write_documents(path / "docs.jsonl")


@pytest.fixture(scope="module")
def reference(workdir):
    """Single-process QLoRA: the same 4-bit base, the same rows."""
    path, data = workdir
    train(write_config(path, "one", data, **QLORA), 1)
    return path / "one"


def test_fsdp_qlora_under_sp_matches_single_process_qlora(workdir, reference):
    """sp=2 with FSDP sharding the 4-bit base over both ranks: per-step loss, eval loss and
    the final adapter equal the single-process run within 1e-5 relative, the tolerance of the
    repo's float32 SP parity tests (measured: losses 1e-8, adapter weights 1.1e-6). The
    4-bit weights are the same bytes in both runs (see the test above); what differs is the
    float32 summation order of SP attention and of FSDP's reduce-scatter."""
    path, data = workdir
    train(write_config(path, "fsdp", data, **QLORA, sequence_parallel_degree=2, fsdp=True), 2)
    assert_same_run(path / "fsdp", reference, adapter=True, tol=1e-5)
    losses = [m["loss"] for m in read_metrics(reference)]
    assert losses[-1] < losses[0]  # the adapter trained
    adapter = final_tensors(path / "fsdp", adapter=True)
    assert any("lora_B" in k and float(v.abs().max()) > 0 for k, v in adapter.items())


@pytest.mark.slow
def test_hsdp_qlora_checkpointed_and_resumed_matches(workdir, reference):
    """HSDP (2 replicas x sp 2 = 4 ranks), gradient checkpointing and no parameter
    resharding, with a checkpoint at step 2: the run equals the single-process one (1e-5, as
    above), and resuming from its checkpoint-2 ends on the same adapter bit for bit."""
    path, data = workdir
    options = {**QLORA, "sequence_parallel_degree": 2, "fsdp": True, "dp_replicate_size": 2,
               "gradient_accumulation_steps": 2, "gradient_checkpointing": True,
               "fsdp_config": {"reshard_after_forward": False}, "save_steps": 2}
    train(write_config(path, "hsdp", data, **options), 4)
    assert_same_run(path / "hsdp", reference, adapter=True, tol=1e-5)
    (path / "resumed").mkdir()
    shutil.copytree(path / "hsdp" / "checkpoint-2", path / "resumed" / "checkpoint-2")
    train(write_config(path, "resumed", data, resume_from_checkpoint="auto", **options), 4)
    assert [m["step"] for m in read_metrics(path / "resumed")] == [3]
    want, got = final_tensors(path / "hsdp", adapter=True), final_tensors(path / "resumed",
                                                                           adapter=True)
    assert want.keys() == got.keys()
    assert max(relative_error(got[k], want[k]) for k in want) == 0.0


# ---- validate -----------------------------------------------------------------------------


def _validate(tmp_path: Path, **overrides):
    import yaml

    from longctx_cli.cli import app

    config = yaml.safe_load((ROOT / "examples" / "llama3-8b-lora-64k.yaml").read_text())
    config.update({"adapter": "qlora", **overrides})
    # The sample the example ships, wherever the test runs from.
    config["datasets"][0]["path"] = str(ROOT / "examples" / "data" / "long_documents.jsonl")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "8"])
    return result.exit_code, " ".join(result.output.split())


def test_validate_shows_the_sharded_4bit_base_per_rank(tmp_path, monkeypatch):
    """Llama-3.1-8B QLoRA (r 16, every linear layer) on 8 ranks. Its decoder's 6.98e9
    linear weights pack into 3.25 GiB, their double-quantized scales take 105.6 MiB; the
    embeddings and lm_head stay bf16 (1.96 GiB), the adapter float32 (160 MiB). Alone a rank
    holds all of it, 5.47 GiB; with FSDP an eighth of everything but the scales, plus two
    gathered layers (2 x 5.21 GiB / 32 layers): 1.10 GiB."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the built-in shape
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    code, plain = _validate(tmp_path)
    assert code == 0, plain
    code, sharded = _validate(tmp_path, fsdp=True)
    assert code == 0, sharded
    assert "parameters │ 8.07B (41.9M trainable, LoRA), bfloat16" in plain
    assert "fsdp │ no" in plain and "FSDP-QLoRA" not in plain
    assert "parameters │ 5.47 GiB" in plain
    assert "fsdp │ FSDP2, full shard" in sharded
    assert "parameters │ 1.10 GiB" in sharded
    assert ("FSDP-QLoRA: the packed 4-bit weights (3.25 GiB) are sharded over 8 ranks, "
            "416.0 MiB per rank; their quantization scales (105.6 MiB) stay whole on every "
            "rank.") in sharded


@pytest.mark.parametrize(("overrides", "message"), [
    ({"adapter": "lora", "load_in_8bit": True, "fsdp": True},
     "FSDP with an 8-bit base (`load_in_8bit`) cannot run"),
    ({"tensor_parallel_size": 2, "sequence_parallel_degree": 4, "fsdp": True},
     "`tensor_parallel_size` = 2 with a 4-bit base cannot run"),
])
def test_what_cannot_shard_a_quantized_base_is_refused(tmp_path, monkeypatch, overrides,
                                                       message):
    """Both fail in the first forward when run (an 8-bit layer's row scales live on the
    weight tensor FSDP2 replaces; bitsandbytes cannot wrap a TP DTensor): refused instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = _validate(tmp_path, **overrides)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out

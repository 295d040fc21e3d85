"""Context extension (`rope_scaling`, `rope_theta`) against the model's own computation.

A tiny Llama whose native context is 64 positions trains on packed rows whose documents run
to 150 tokens, far past it, with Axolotl's `rope_scaling` (and `rope_theta`). The reference
is the model's own Hugging Face training of the scaled model (eager attention, each document
through `forward(labels=)`, the same optimizer); longctx trains the same rows at sp 1 and
under the rings and Ulysses at sp 2. The scaling is active: without it the loss differs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.family_matrix import compare
from tests.train_helpers import run_longctx, write_config, write_documents

NATIVE = 64
DOCS = [(150, 40, 66), (9, 120, 127), (1, 200, 55), (70, 70, 116)]  # two rows per step
STEPS, ACCUMULATION, LR = 2, 2, 0.01
MODEL = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "max_position_embeddings": NATIVE, "initializer_range": 0.2}
SCALINGS = {
    "yarn": {"type": "yarn", "factor": "auto"},
    "linear": {"type": "linear", "factor": 4},
    "llama3": {"rope_type": "llama3", "factor": 4, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
}


def _config(scaling: dict[str, Any] | None, **overrides: Any):
    from longctx_cli.config import Config

    rope = {"rope_scaling": scaling, "rope_theta": 20000.0} if scaling is not None else {}
    return Config(model_config=MODEL, datasets=[{"path": "unused"}], dtype="float32",
                  attention_kernel="torch", learning_rate=LR, adam_epsilon=1e-6,
                  lr_scheduler="constant", gradient_accumulation_steps=ACCUMULATION,
                  max_steps=STEPS, seed=7, sequence_len=256, **rope, **overrides)


def _row(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + index)
    ids = torch.randint(3, MODEL["vocab_size"], (sum(DOCS[index]),), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS[index]])
    labels = ids.clone()
    labels[pos == 0] = -100
    return ids, pos, labels


def _documents(step: int) -> list[torch.Tensor]:
    out = []
    for i in range(step * ACCUMULATION, (step + 1) * ACCUMULATION):
        out += [d for d in torch.split(_row(i)[0], list(DOCS[i])) if d.numel() > 1]
    return out


def _weights(model: torch.nn.Module) -> dict[str, Any]:
    return {k: v.detach().double().numpy().copy() for k, v in model.named_parameters()}


def reference(scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The model's own training of the (scaled) model: eager attention, per document."""
    from longctx_cli.runtime.model import load_base_model
    from longctx_cli.train.optim import make_optimizer
    from tests.own_training import own_training

    config = _config(scaling)
    model = load_base_model(config, "eager").train()
    optimizer = make_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    steps = [[(d, None) for d in _documents(step)] for step in range(STEPS)]
    return {**own_training(model, optimizer, steps, config.training.max_grad_norm),
            "config": model.config.to_dict()}


def _longctx(rank: int, world_size: int, scaling: dict[str, Any],
             layout: dict[str, Any]) -> dict[str, Any]:
    """What `longctx train` runs on each rank: the plan (`check_run`), the probe, the step."""
    import os

    from longctx_cli.checks.fidelity import check_fidelity
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.preflight import check_run
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.step import train_step

    os.environ["WORLD_SIZE"] = str(world_size)
    config = _config(scaling, sequence_parallel_degree=world_size, **layout)
    _, plan = check_run(config, "train", world_checks=False)
    hf_config = plan.model.transformers_config()
    check_fidelity(config, hf_config)
    state = build_parallel_state(plan.layout, torch.device("cpu"))
    model = build_model(config, state, hf_config)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    losses = []
    for step in range(STEPS):
        rows = range(step * ACCUMULATION, (step + 1) * ACCUMULATION)
        batches = [shard_batch(*_row(i), state, 0) for i in rows]
        losses.append(train_step(model, decoder, head, params, optimizer, batches, config,
                                 state, use_fsdp=False).loss)
    return {"losses": losses, "weights": _weights(model), "context": plan.model.context}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {name: reference(scaling) for name, scaling in SCALINGS.items()}


def test_the_scaling_is_active_past_the_native_context(references):
    plain = reference(None)
    for name, ref in references.items():
        assert abs(ref["losses"][0] - plain["losses"][0]) > 1e-3 * plain["losses"][0], name
    yarn = references["yarn"]["config"]
    # factor auto: sequence_len 256 over 64 native positions.
    assert yarn["rope_parameters"]["factor"] == 4.0
    assert yarn["rope_parameters"]["original_max_position_embeddings"] == NATIVE
    assert yarn["rope_parameters"]["rope_theta"] == 20000.0
    assert yarn["max_position_embeddings"] == 4 * NATIVE


LAYOUTS = {
    "sp1": (1, {}),
    "ring_stripe_sp2": (2, {}),
    "varlen_llama3_zigzag_sp2": (2, {"ring_attn_func": "varlen_llama3", "sp_sharding": "zigzag"}),
    "ulysses_sp2": (2, {"sequence_parallel_mode": "ulysses"}),
}


# By default sp 1 and the default ring; the llama3 ring and Ulysses with -m slow.
@pytest.mark.parametrize("layout", [
    name if name in ("sp1", "ring_stripe_sp2") else pytest.param(name, marks=pytest.mark.slow)
    for name in LAYOUTS])
def test_yarn_training_equals_the_models_own(references, layout):
    world, settings = LAYOUTS[layout]
    runs = run_distributed(_longctx, world, SCALINGS["yarn"], settings, timeout_s=240)
    result = compare(runs[0], references["yarn"])
    assert result["loss"] < 1e-5 and result["weights"] < 1e-4, result
    assert "yarn x4 RoPE scaling reaches 256" in runs[0]["context"]


@pytest.mark.parametrize("name", [pytest.param("linear", marks=pytest.mark.slow), "llama3"])
def test_other_static_scalings_under_the_ring_equal_the_models_own(references, name):
    runs = run_distributed(_longctx, 2, SCALINGS[name], {}, timeout_s=240)
    result = compare(runs[0], references[name])
    assert result["loss"] < 1e-5 and result["weights"] < 1e-4, result


def test_train_saves_the_scaling_and_plain_transformers_loads_it(tmp_path):
    """`final/` and `checkpoint-*/` carry the scaling; `from_pretrained` computes with it."""
    from transformers import AutoModelForCausalLM

    data = write_documents(tmp_path / "docs.jsonl", count=48)
    config = write_config(tmp_path, "run", data, model_config=MODEL, sequence_len=256,
                          rope_scaling={"type": "yarn", "factor": "auto"}, rope_theta=20000.0,
                          sequence_parallel_degree=2, max_steps=2, save_steps=1,
                          eval_steps=None, val_set_size=0)
    validate = run_longctx("validate", str(config), "--nproc-per-node", "2",
                           env={"COLUMNS": "250"})  # the plan table, unwrapped
    assert validate.returncode == 0, validate.stderr[-2000:]
    assert "64 native positions; yarn x4 RoPE scaling reaches 256, rope theta 20000" in \
        validate.stdout
    result = run_longctx("train", str(config), "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    for folder in ("final", "checkpoint-1"):
        saved = json.loads((tmp_path / "run" / folder / "config.json").read_text())
        assert saved["rope_parameters"]["rope_type"] == "yarn", folder
        assert saved["rope_parameters"]["factor"] == 4.0
        assert saved["rope_parameters"]["rope_theta"] == 20000.0
        assert saved["max_position_embeddings"] == 256
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    rope = model.model.rotary_emb
    assert rope.rope_type == "yarn" and rope.attention_scaling > 1.0


def test_length_dependent_scalings_are_refused_with_the_reason(tmp_path):
    data = write_documents(tmp_path / "docs.jsonl", count=8)
    for scaling in ({"type": "dynamic", "factor": 2}, {"rope_type": "longrope", "factor": 2}):
        config = write_config(tmp_path, "run", data, model_config=MODEL, sequence_len=128,
                              rope_scaling=scaling)
        result = run_longctx("validate", str(config))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "longest position of each forward pass" in " ".join(result.stderr.split())


def test_sequence_len_beyond_what_the_scaling_reaches_is_refused(tmp_path):
    data = write_documents(tmp_path / "docs.jsonl", count=8)
    config = write_config(tmp_path, "run", data, model_config=MODEL, sequence_len=512,
                          rope_scaling={"type": "linear", "factor": 2})
    result = run_longctx("validate", str(config))
    err = " ".join(result.stderr.split())
    assert result.returncode == 2 and "rope_scaling.factor" in err
    assert "beyond the 128 positions the RoPE scaling reaches" in err

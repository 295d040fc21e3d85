"""`validate` with `tensor_parallel_size`: the dp x cp x tp layout, its rules and memory."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from longctx_cli.cli import app
from longctx_cli.config import config_from_dict
from longctx_cli.config.plan import build_plan
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.world import Platform
from longctx_cli.errors import UserError

CPU = Platform(cuda=False, ring_flash_attn=False)
SMALL = ModelShape(model_type="llama", hidden_size=128, intermediate_size=256,
                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=16, vocab_size=384, max_position_embeddings=8192)


def plan(world=8, shape=SMALL, **overrides):
    base = {"model_config": {"model_type": "llama"}, "sequence_len": 4096}
    return build_plan(config_from_dict({**base, **overrides}), world, shape, platform=CPU)


def rule_error(world=8, shape=SMALL, **overrides) -> str:
    with pytest.raises(UserError) as exc:
        plan(world, shape, **overrides)
    return " ".join(str(exc.value).split())


def text_of(p) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(p.to_table())
    return " ".join(out.getvalue().split())


def test_layout_dp_cp_tp_with_tp_fastest():
    p = plan(8, tensor_parallel_size=2, sequence_parallel_degree=2)
    assert (p.layout.dp, p.layout.sp, p.layout.tp) == (2, 2, 2)
    text = text_of(p)
    assert "dp 2 x cp 2 x tp 2" in text
    assert "TP groups = 2 consecutive ranks, e.g. [0, 1]" in text
    assert "SP groups = ranks 2 apart, e.g. [0, 2]" in text


def test_world_must_be_dp_x_tp_x_cp():
    msg = rule_error(6, tensor_parallel_size=2, sequence_parallel_degree=2)
    assert "does not divide the world size 6" in msg and "dp x tp x cp" in msg


@pytest.mark.parametrize(
    ("field", "shape_change", "tp"),
    [
        ("num_key_value_heads", {}, 4),  # 2 KV heads over 4 ranks
        ("num_attention_heads", {"num_attention_heads": 6, "num_key_value_heads": 6}, 4),
        ("intermediate_size", {"intermediate_size": 250, "num_key_value_heads": 8}, 4),
    ],
)
def test_heads_kv_heads_intermediate_divisible_by_tp(field, shape_change, tp):
    from dataclasses import replace

    msg = rule_error(8, replace(SMALL, **shape_change), tensor_parallel_size=tp)
    assert field in msg and f"not divisible by {tp}" in msg


def test_sp_rules_apply_to_the_heads_tp_leaves():
    # 8 heads / tp 2 = 4 local heads: Ulysses over 8 ranks cannot split them.
    msg = rule_error(16, tensor_parallel_size=2, sequence_parallel_degree=8,
                     sequence_parallel_mode="ulysses")
    assert "num_attention_heads = 4" in msg
    # 2 KV heads / tp 2 = 1 local KV head: heads_k_stride 2 no longer divides it.
    msg = rule_error(4, tensor_parallel_size=2, sequence_parallel_degree=2, heads_k_stride=2)
    assert "heads_k_stride" in msg


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"tiled_mlp": True}, "tiled_mlp"),
        ({"activation_offloading": True}, "activation_offloading"),
        ({"adapter": "lora", "lora_dropout": 0.1}, "lora_dropout"),
        ({"sequence_len": 4098}, "multiple of 4"),
    ],
)
def test_unsupported_combinations_are_refused(overrides, words):
    msg = rule_error(4, tensor_parallel_size=2, sequence_parallel_degree=2, **overrides)
    assert words in msg


def test_families_without_a_dense_tp_plan_are_refused():
    from dataclasses import replace

    msg = rule_error(2, replace(SMALL, model_type="gemma2"), tensor_parallel_size=2)
    assert "gemma2" in msg and "not supported" in msg
    # Qwen3 (per-head q/k norms) and tied embeddings are sharded (tests/test_tensor_parallel.py).
    assert plan(2, replace(SMALL, model_type="qwen3"), tensor_parallel_size=2)
    assert plan(2, replace(SMALL, tie_word_embeddings=True), tensor_parallel_size=2)


def test_memory_per_rank_shrinks_with_tp():
    one = plan(2, sequence_parallel_degree=2).memory
    two = plan(4, sequence_parallel_degree=2, tensor_parallel_size=2).memory
    assert two.total_params == one.total_params
    # Weights, gradients and optimizer state are split (norms stay whole: slightly over 1/2).
    assert one.parameters / 2 <= two.parameters < one.parameters * 0.51
    assert two.activations < one.activations
    # TP's vocab-parallel loss holds the shard's logits over half the vocabulary; one rank
    # without TP fuses its loss (one block of logits), which FSDP2 does not.
    unfused = plan(2, sequence_parallel_degree=2, fsdp=True).memory
    assert two.logits == pytest.approx(unfused.logits / 2, rel=0.01)
    assert one.logits < unfused.logits


def test_70b_example_validates_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    # The example's data path is relative to the repository's root, where its sample is.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    example = "examples/llama3.1-70b-tp8-sp4-fsdp.yaml"
    result = CliRunner().invoke(app, ["validate", example, "--nproc-per-node", "8",
                                      "--nnodes", "4", "--fidelity-probe", "false"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "dp 1 x cp 4 x tp 8" in out and "70.6B" in out
    total = next(line for line in result.output.splitlines() if " total " in line)
    assert "GiB" in total and float(total.split("│")[2].split()[0]) < 80  # fits an 80 GB GPU


def test_tp_across_nodes_gets_a_note():
    base = {"model_config": {"model_type": "llama"}, "sequence_len": 4096,
            "tensor_parallel_size": 8}
    shape = ModelShape(model_type="llama", hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                       head_dim=16, vocab_size=384)
    p = build_plan(config_from_dict(base), 8, shape, platform=CPU, nproc_per_node=4)
    assert any("span nodes" in n for n in p.notes)

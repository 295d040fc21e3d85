"""What validate and the ranks say about Llama 4 (chunked attention, NoPE temperature tuning)
and multi-head latent attention (DeepSeek V3), beyond the family matrix's exactness.

* A chunk size is read per layer from the config the model itself reads (`layer_types`);
  a config whose chunked layers cannot be told is refused, never trained as plain causal.
* Llama 4's NoPE layers scale queries by the token's index in the forward's input: the SP
  attention puts back each token's index in its dataset row (tests/test_temperature_tuning.py
  shows it exact); where longctx does not know the model's own rows (pairs, groups) and an
  index reaches `floor_scale`, validate and the ranks refuse.
* Flash kernels pad latent attention's value head dim (validate says so) and size their
  head-dim limit on the padded dim; a P2P ring's flash-attn functions cannot take chunks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longctx_cli.config import config_from_dict
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.plan import build_plan
from longctx_cli.config.sections.model import chunked_attention, latent_head_dims, model_attention
from longctx_cli.config.world import Platform
from longctx_cli.errors import UserError
from longctx_cli.kernel_choice import ModelAttention, flash_attn_blockers
from longctx_cli.parallel.attention import layer_chunk

CPU = Platform(cuda=False, ring_flash_attn=False)
H100 = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0))
LLAMA4 = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 64,
          "intermediate_size_mlp": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
          "num_local_experts": 2}
DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 64,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 8, "vocab_size": 128, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}


def _plan(model: dict, world: int = 1, platform: Platform = CPU, **settings):
    config = config_from_dict({"model_config": model, "tokenizer": "byte", **settings})
    return build_plan(config, world, read_model_config(config), platform=platform)


# ---- chunked attention ------------------------------------------------------------------


def test_a_layer_s_chunk_comes_from_the_config_the_model_reads() -> None:
    config = SimpleNamespace(attention_chunk_size=8192,
                             layer_types=["chunked_attention", "full_attention"])
    assert layer_chunk(SimpleNamespace(config=config, layer_idx=0)) == 8192
    assert layer_chunk(SimpleNamespace(config=config, layer_idx=1)) is None
    assert layer_chunk(SimpleNamespace(config=SimpleNamespace(), layer_idx=0)) is None
    unknown = SimpleNamespace(attention_chunk_size=8192, layer_types=None)
    with pytest.raises(ValueError, match="cannot tell which layers use chunked attention"):
        layer_chunk(SimpleNamespace(config=unknown, layer_idx=0))


def test_a_chunked_model_keeps_flash_attn_s_p2p_rings_off() -> None:
    shape = read_model_config(config_from_dict({"model_config": LLAMA4, "tokenizer": "byte"}))
    assert chunked_attention(shape) and model_attention(shape).chunked
    why = flash_attn_blockers(Platform(cuda=True, ring_flash_attn=True), "bfloat16",
                              model_attention(shape), "stripe", "batch_stripe", ring=2)
    assert any("chunked attention" in w for w in why), why
    # The llama3 ring takes the chunks as cu_seqlens: nothing to refuse there.
    assert not flash_attn_blockers(Platform(cuda=True, ring_flash_attn=True), "bfloat16",
                                   model_attention(shape), "contiguous", "varlen_llama3", 2)


# ---- Llama 4's NoPE temperature tuning -----------------------------------------------------


def test_temperature_tuning_is_refused_where_the_rows_are_not_known() -> None:
    pairs = {"rl": "dpo", "datasets": [{"path": "x.jsonl", "type": "chatml.intel"}]}
    with pytest.raises(UserError) as err:
        _plan(LLAMA4, world=2, sequence_len=16384, sequence_parallel_degree=2, **pairs)
    message = str(err.value)
    assert message.startswith("sequence_len: the model's NoPE layers scale queries")
    assert "floor_scale = 8192" in message and "`rl: dpo` splits" in message
    assert "overrides_of_model_config: {attn_temperature_tuning: false}" in message
    assert "\n" not in message
    # Causal-LM rows: each dataset row is one of the model's own rows, at any sp, packed or
    # not, micro-batches of several rows; below floor_scale every scale is 1; without
    # temperature tuning nothing depends on the index.
    _plan(LLAMA4, world=2, sequence_len=16384, sequence_parallel_degree=2, micro_batch_size=2)
    _plan(LLAMA4, sequence_len=16384)
    _plan(LLAMA4, world=2, sequence_len=8190, sequence_parallel_degree=2, **pairs)
    _plan(LLAMA4, world=2, sequence_len=16384, sequence_parallel_degree=2, **pairs,
          overrides_of_model_config={"attn_temperature_tuning": False})


def test_the_ranks_refuse_temperature_tuning_where_it_differs() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel import ParallelState, shard_batch
    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.runtime.head import decoder_of
    from longctx_cli.runtime.model import sp_hidden_states

    pos = torch.cat([torch.arange(n) for n in (10, 30, 24)])  # packed, 64 tokens
    batch = shard_batch(pos, pos, pos, ParallelState())  # its rows not given: unknown
    for floor, refused in ((16, True), (8192, False)):
        config = AutoConfig.for_model(**LLAMA4, floor_scale=floor)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=(
            register_sp_attention()))
        batch.sp_meta.attention_calls = 0
        if refused:
            with pytest.raises(ValueError, match="attn_temperature_tuning, floor_scale=16"):
                sp_hidden_states(decoder_of(model), batch)
        else:
            sp_hidden_states(decoder_of(model), batch)


# ---- multi-head latent attention ----------------------------------------------------------


def test_latent_attention_head_dims_and_the_flash_padding_note() -> None:
    shape = read_model_config(config_from_dict({"model_config": DEEPSEEK, "tokenizer": "byte"}))
    assert latent_head_dims(shape) == (192, 128)  # q/k 128 + 64, v 128: the family defaults
    assert model_attention(shape).head_dim == 192  # what a flash kernel computes on
    plan = _plan(DEEPSEEK, platform=H100, dtype="bfloat16")
    assert plan.layout.kernel == "torch_flash"
    assert any("padded with zeros from 128 to 192 dims" in n for n in plan.notes), plan.notes
    assert not any("padded" in n for n in _plan(DEEPSEEK).notes)  # the torch kernel on CPU
    wide = {**DEEPSEEK, "qk_nope_head_dim": 256}  # q/k 320: beyond flash attention's 256
    with pytest.raises(UserError, match="head_dim 320"):
        _plan(wide, platform=H100, dtype="bfloat16", attention_kernel="torch_flash")


def test_the_flash_blockers_read_the_padded_head_dim() -> None:
    blockers = flash_attn_blockers(H100, "bfloat16", ModelAttention(head_dim=320),
                                   "contiguous", "varlen_llama3", 1)
    assert any("head_dim 320" in b for b in blockers)

"""Every validation rule of the plan (one test each), the resolved plan and its memory estimate."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from longctx_cli.config import config_from_dict
from longctx_cli.config.fit import parse_memory_size, smallest_fitting_sp
from longctx_cli.config.memory_estimate import estimate_memory, lora_parameter_count
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.plan import Plan, build_plan, layout_for
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.units import DTYPE_BYTES
from longctx_cli.config.world import Platform, resolve_world, resolve_world_size
from longctx_cli.errors import UserError

CPU = Platform(cuda=False, ring_flash_attn=False)
GPU = Platform(cuda=True, ring_flash_attn=True)
GPU_NO_FLASH = Platform(cuda=True, ring_flash_attn=False)

# A Llama-like model with 8 heads and 2 KV heads (the bundled example's shape).
SMALL = ModelShape(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=384,
    max_position_embeddings=8192,
)
# Llama-3-8B's published shape.
LLAMA3_8B = ModelShape(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
)


def cfg(**overrides):
    base = {"model_config": {"model_type": "llama"}, "sequence_len": 4096}
    return config_from_dict({**base, **overrides})


def plan(world=4, shape=SMALL, platform=CPU, **overrides) -> Plan:
    return build_plan(cfg(**overrides), world, shape, platform=platform)


def rule_error(world=4, shape=SMALL, platform=CPU, **overrides) -> str:
    with pytest.raises(UserError) as exc:
        plan(world, shape, platform, **overrides)
    return " ".join(str(exc.value).split())


# ---- one test per rule ------------------------------------------------------------------


def test_rule_sp_not_larger_than_world():
    msg = rule_error(world=4, sequence_parallel_degree=8)
    assert "`sequence_parallel_degree` = 8 is larger than the world size 4" in msg
    assert "Fix:" in msg and "1, 2 or 4" in msg


def test_rule_sp_divides_world():
    msg = rule_error(world=4, sequence_parallel_degree=3)
    assert "`sequence_parallel_degree` = 3 does not divide the world size 4" in msg
    assert "1, 2 or 4" in msg


def test_rule_ulysses_degree_only_for_hybrid():
    msg = rule_error(sequence_parallel_degree=2, ulysses_degree=2)
    assert "`ulysses_degree` = 2 is only used by `sequence_parallel_mode: hybrid`" in msg
    assert "'ring'" in msg


def test_rule_hybrid_needs_ulysses_degree():
    msg = rule_error(sequence_parallel_degree=4, sequence_parallel_mode="hybrid")
    assert "`sequence_parallel_mode: hybrid` needs `ulysses_degree`" in msg
    assert "`sequence_parallel_degree` = 4" in msg


def test_rule_ulysses_degree_divides_sp():
    msg = rule_error(
        world=8, sequence_parallel_degree=8, sequence_parallel_mode="hybrid", ulysses_degree=3
    )
    assert "`ulysses_degree` = 3 does not divide `sequence_parallel_degree` = 8" in msg


def test_rule_heads_k_stride_divides_kv_heads():
    msg = rule_error(sequence_parallel_degree=2, heads_k_stride=3)
    assert "`heads_k_stride` = 3 does not divide the model's num_key_value_heads = 2" in msg
    assert "set `heads_k_stride` to 1 or 2" in msg


def test_rule_heads_k_stride_against_kv_heads_left_after_ulysses():
    # 8 KV heads over Ulysses groups of 4: each rank's ring sees 2 KV heads, so stride 4 fails.
    msg = rule_error(
        world=8, shape=LLAMA3_8B, sequence_parallel_degree=8, sequence_parallel_mode="hybrid",
        ulysses_degree=4, heads_k_stride=4,
    )
    assert "`heads_k_stride` = 4" in msg
    assert "num_key_value_heads = 8 (2 per rank after the all-to-all)" in msg


def test_rule_heads_k_stride_ignored_without_a_ring():
    p = plan(sequence_parallel_degree=2, sequence_parallel_mode="ulysses", heads_k_stride=3)
    assert p.layout.ring == 1


def test_rule_ulysses_needs_a_head_per_rank():
    shape = replace(SMALL, num_attention_heads=3, num_key_value_heads=3)
    msg = rule_error(shape=shape, sequence_parallel_degree=4, sequence_parallel_mode="ulysses")
    assert "`sequence_parallel_degree` = 4" in msg
    assert "num_attention_heads = 3 is fewer than the Ulysses group size 4" in msg
    assert "use a Ulysses size of at most 3" in msg


def test_rule_ulysses_head_per_rank_names_ulysses_degree_in_hybrid():
    shape = replace(SMALL, num_attention_heads=2, num_key_value_heads=2)
    msg = rule_error(
        world=8, shape=shape, sequence_parallel_degree=8, sequence_parallel_mode="hybrid",
        ulysses_degree=4,
    )
    assert "`ulysses_degree` = 4" in msg


SMOLLM2 = replace(SMALL, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def plan_text(p: Plan) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(p.to_table())
    return " ".join(console.file.getvalue().replace("│", " ").split())  # words only


@pytest.mark.parametrize(
    ("sp", "mode", "extra", "shares"),
    [(2, "ulysses", {}, "6, 3 query heads per rank (KV heads 2, 1)"),
     (4, "ulysses", {}, "2, 1, 3, 3 query heads per rank (KV heads 1, 1, 1, 1, replicated)"),
     (4, "hybrid", {"ulysses_degree": 2}, "6, 3 query heads per rank (KV heads 2, 1)")],
)
def test_rule_ulysses_splits_uneven_heads_by_kv_groups(sp, mode, extra, shares):
    """SmolLM2's 9 heads / 3 KV heads over 2 or 4 Ulysses ranks: accepted, and the plan
    shows each rank's heads and how far the largest is above the mean."""
    p = plan(world=sp, shape=SMOLLM2, sequence_parallel_degree=sp, sequence_parallel_mode=mode,
             **extra)
    text = plan_text(p)
    assert f"ulysses heads {shares}; the largest 1.33x the mean" in text
    assert any("do not divide evenly" in n for n in p.notes)
    even = plan(world=sp, sequence_parallel_degree=sp, sequence_parallel_mode=mode, **extra)
    assert "ulysses heads" not in plan_text(even)  # 8 heads / 2 KV heads split evenly


def test_uneven_ulysses_memory_follows_the_largest_rank():
    """The all-to-all buffers are sized by the rank with the most heads: of 9 heads / 3 KV
    heads over 2 ranks, 6 query and 2 KV heads for the group's tokens (not written over the
    spent q, k, v, which an uneven head layout does not fit), plus the output's 9 heads."""
    p = plan(world=2, shape=SMOLLM2, sequence_parallel_degree=2,
             sequence_parallel_mode="ulysses", ulysses_head_chunks=1)
    local_tokens, b = 4096 // 2, DTYPE_BYTES[p.dtype]
    head_layout = 2 * (6 + 2 * 2)  # the group's tokens (2 x local) for one rank's heads
    assert p.memory.attention_buffers == local_tokens * 64 * (head_layout + 9) * b


def test_rule_ulysses_head_chunks_keep_the_split():
    msg = rule_error(world=2, shape=SMOLLM2, sequence_parallel_degree=2,
                     sequence_parallel_mode="ulysses", ulysses_head_chunks=2)
    assert "`ulysses_head_chunks` = 2 cannot cut 9 heads with 3 KV heads" in msg
    assert "use one of 1, 3" in msg
    p = plan(world=2, shape=SMOLLM2, sequence_parallel_degree=2,
             sequence_parallel_mode="ulysses", ulysses_head_chunks=3)
    assert p.layout.head_chunks == 3
    assert "3 (2 heads per rank at a time" in plan_text(p)


def test_rule_hybrid_heads_k_stride_divides_every_ranks_kv_heads():
    msg = rule_error(world=4, shape=SMOLLM2, sequence_parallel_degree=4,
                     sequence_parallel_mode="hybrid", ulysses_degree=2, heads_k_stride=2,
                     ring_attn_func="varlen_llama3")
    assert "num_key_value_heads = 3 (1 or 2 per rank after the all-to-all)" in msg
    assert "set `heads_k_stride` to 1" in msg


def test_rule_ulysses_replicates_fewer_kv_heads():
    p = plan(sequence_parallel_degree=4, sequence_parallel_mode="ulysses")  # 2 KV heads, 4 ranks
    assert p.layout.ulysses == 4
    assert any("replicated" in n for n in p.notes)


def test_rule_sequence_len_multiple_of_sp():
    msg = rule_error(world=4, sequence_parallel_degree=4, sequence_len=4098)
    assert "`sequence_len` = 4098 is not a multiple of 4" in msg
    assert "4096 or 4100" in msg


def test_rule_sequence_len_multiple_of_twice_sp_for_zigzag():
    msg = rule_error(sequence_parallel_degree=4, sp_sharding="zigzag", sequence_len=4100)
    assert "`sequence_len` = 4100 is not a multiple of 8" in msg
    assert "zigzag" in msg
    assert plan(sequence_parallel_degree=4, sequence_len=4100).layout.sp == 4  # contiguous is fine


def test_rule_zigzag_not_with_flash_kernel():
    msg = rule_error(
        platform=GPU, sequence_parallel_degree=2, sp_sharding="zigzag", attention_kernel="flash"
    )
    assert "`sp_sharding` = 'zigzag' is not supported by `attention_kernel: flash`" in msg


def test_rule_flash_needs_cuda():
    msg = rule_error(platform=CPU, sequence_parallel_degree=2, attention_kernel="flash")
    assert "`attention_kernel: flash` cannot run" in msg and "no CUDA GPU" in msg


def test_rule_flash_needs_cuda_on_this_machine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="`attention_kernel: flash` cannot run"):
        build_plan(cfg(attention_kernel="flash"), 1, SMALL)  # platform detected


def test_rule_flash_needs_ring_flash_attn():
    msg = rule_error(platform=GPU_NO_FLASH, sequence_parallel_degree=2, attention_kernel="flash")
    assert "flash-attn 2 / ring-flash-attn do not import here" in msg
    assert "docs/gpu.md" in msg


def test_rule_lora_targets_not_empty():
    msg = rule_error(adapter="lora", lora_target_modules=[])
    assert "`lora_target_modules` = [] is empty" in msg
    msg = rule_error(adapter="lora", lora_target_modules=" ")
    assert "`lora_target_modules` = ' ' is empty" in msg


def test_rule_nnodes_needs_nproc_per_node():
    with pytest.raises(UserError) as exc:
        resolve_world(cfg(), None, 2)
    assert "--nnodes 2 was given without --nproc-per-node" in str(exc.value)


def test_rule_world_size_env_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(UserError, match="WORLD_SIZE = 'four'"):
        resolve_world_size(cfg())


def test_rule_unknown_model_type():
    with pytest.raises(UserError) as exc:
        read_model_config(cfg(model_config={"model_type": "no_such_model"}))
    assert "`model_config.model_type` = 'no_such_model'" in str(exc.value)


def test_rule_model_config_bad_field():
    with pytest.raises(UserError, match="`model_config` is invalid"):
        read_model_config(cfg(model_config={"model_type": "llama", "hidden_size": "big"}))


# ---- kernel resolution ------------------------------------------------------------------


def test_auto_kernel_is_torch_without_cuda():
    p = plan(platform=CPU, sequence_parallel_degree=2)
    assert (p.layout.kernel, p.layout.kernel_reason) == ("torch", "auto: no CUDA GPU")


def test_auto_kernel_is_flash_with_cuda_and_ring_flash_attn():
    llama3 = {"sequence_parallel_degree": 2, "ring_attn_func": "varlen_llama3"}
    assert plan(platform=GPU, **llama3).layout.kernel == "flash"
    assert plan(platform=GPU_NO_FLASH, **llama3).layout.kernel == "torch_flash"
    # The default ring (batch_stripe) on packed rows: PyTorch's op, whatever is installed.
    assert plan(platform=GPU, sequence_parallel_degree=2).layout.kernel == "torch_flash"


def test_auto_kernel_with_zigzag_on_cuda_is_torch_flash():
    p = plan(platform=GPU, sequence_parallel_degree=2, sp_sharding="zigzag")
    assert p.layout.kernel == "torch_flash"
    assert "zigzag" in p.layout.kernel_reason


def test_auto_kernel_float32_on_cuda_is_the_tiled_torch_path():
    p = plan(platform=GPU_NO_FLASH, sequence_parallel_degree=2, dtype="float32")
    assert p.layout.kernel == "torch" and "tiled" in p.layout.kernel_reason
    assert p.memory.score_tiles > 0  # the estimate budgets the tiles that path holds


def test_rule_torch_flash_needs_cuda_and_half_precision():
    msg = rule_error(platform=CPU, attention_kernel="torch_flash")
    assert "`attention_kernel: torch_flash` cannot run: no CUDA GPU" in msg
    msg = rule_error(platform=GPU_NO_FLASH, attention_kernel="torch_flash", dtype="float32")
    assert "bf16/fp16" in msg and "dtype" in msg


def test_flash_kernels_hold_no_score_tiles_but_softcap_does():
    for kernel in ("torch_flash", "flash"):
        p = plan(platform=GPU, attention_kernel=kernel)
        assert p.memory.score_tiles == 0
    assert plan(platform=CPU).memory.score_tiles == 0  # the CPU flash op, no tiles
    assert plan(platform=GPU, attention_kernel="torch").memory.score_tiles > 0
    from transformers import AutoConfig

    gemma2 = ModelShape.from_hf_config(AutoConfig.for_model(
        "gemma2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=384,
    ))
    p = build_plan(cfg(attention_kernel="torch_flash"), 1, gemma2, platform=GPU)
    assert p.layout.kernel == "torch_flash" and "softcap" in p.layout.kernel_reason
    # 5 float32 tiles of [4 heads, 1024, 1024]: the ring (also at sp 1) computes one head
    # group at a time, heads_k_stride = 1 KV head = 4 query heads here.
    assert p.memory.score_tiles == 5 * 4 * 1024 * 1024 * 4


# ---- world size -------------------------------------------------------------------------


def test_world_size_precedence(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_world_size(cfg()) == 1
    assert resolve_world_size(cfg(world_size=6)) == 6
    monkeypatch.setenv("WORLD_SIZE", "12")
    assert resolve_world_size(cfg(world_size=6)) == 12
    assert resolve_world_size(cfg(world_size=6), nproc_per_node=4) == 4
    assert resolve_world_size(cfg(world_size=6), nproc_per_node=8, nnodes=2) == 16


# ---- the plan ---------------------------------------------------------------------------


def test_plan_fields():
    p = plan(world=8, sequence_parallel_degree=4, micro_batch_size=2,
             gradient_accumulation_steps=3, sequence_len=8192)
    lay = p.layout
    assert (p.world_size, lay.dp, lay.sp, lay.ulysses, lay.ring) == (8, 2, 4, 1, 4)
    assert p.micro_batch_tokens == 2 * 8192
    assert p.global_batch_sequences == 2 * 3 * 2
    assert p.global_batch_tokens == 12 * 8192
    assert p.tokens_per_rank_per_forward == 2 * 8192 // 4
    assert p.tokens_per_rank_per_step == 3 * 2 * 8192 // 4
    assert p.layout.kernel in ("torch", "flash", "torch_flash")


def test_plan_hybrid_split():
    p = plan(world=16, shape=LLAMA3_8B, sequence_parallel_degree=16,
             sequence_parallel_mode="hybrid", ulysses_degree=4, heads_k_stride=2)
    assert (p.layout.ulysses, p.layout.ring, p.layout.dp) == (4, 4, 1)


def test_plan_notes_long_sequence_and_cross_node_all_to_all():
    shape = replace(LLAMA3_8B, max_position_embeddings=8192)
    config = cfg(sequence_len=65536, sequence_parallel_degree=16, sequence_parallel_mode="ulysses")
    p = build_plan(config, 16, shape, platform=CPU, nproc_per_node=8)
    assert any("max_position_embeddings 8192" in n for n in p.notes)
    assert any("span nodes" in n for n in p.notes)


def test_plan_table_renders_every_section():
    p = plan(world=4, sequence_parallel_degree=2, sp_sharding="zigzag")
    out = io.StringIO()
    Console(file=out, width=100).print(p.to_table())
    text = out.getvalue()
    for needle in ("data parallel", "sequence parallel", "2 (ring: 1 ulysses x 2 ring)",
                   "tokens per rank", "attention kernel", "optimizer state", "total",
                   "the step's moments"):
        assert needle in text


# ---- model shape ------------------------------------------------------------------------


def test_parameter_count_matches_published_llama3_8b():
    assert LLAMA3_8B.parameter_count() == 8_030_261_248


def test_read_inline_model_config_defaults_kv_heads():
    shape = read_model_config(cfg(model_config={
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
    }))
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 4, 16)
    assert shape.source == "inline `model_config`"


def test_read_local_model_folder(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, intermediate_size=96).save_pretrained(tmp_path)
    shape = read_model_config(cfg(model_config=None, base_model=str(tmp_path)))
    assert (shape.model_type, shape.num_key_value_heads, shape.hidden_size) == ("qwen2", 2, 64)


def test_known_model_offline_uses_builtin_table(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = read_model_config(cfg(model_config=None, base_model="Qwen/Qwen2.5-7B"))
    heads = (shape.num_attention_heads, shape.num_key_value_heads, shape.hidden_size)
    assert heads == (28, 4, 3584)
    assert "built-in table" in shape.source
    p = build_plan(cfg(model_config=None, base_model="Qwen/Qwen2.5-7B"), 1, shape, platform=CPU)
    assert any("built-in table" in n for n in p.notes)


def test_unknown_model_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as exc:
        read_model_config(cfg(model_config=None, base_model="someone/unknown-model"))
    msg = str(exc.value)
    assert "`base_model` = 'someone/unknown-model'" in msg
    assert "unreachable" in msg and "model_config" in msg


# ---- memory estimate --------------------------------------------------------------------


def _estimate(config, shape, world, **kwargs):
    """The estimate for `config`'s layout on `world` ranks."""
    return estimate_memory(config, shape, world, layout_for(config, world, None), **kwargs)


def _memory(world=8, sp=8, shape=LLAMA3_8B, **overrides):
    base = {"sequence_len": 65536, "sequence_parallel_degree": sp}
    return _estimate(cfg(**{**base, **overrides}), shape, world)[0]


def test_memory_full_finetune_bf16_adamw():
    m = _memory()
    n = LLAMA3_8B.parameter_count()
    assert (m.parameters, m.gradients, m.optimizer) == (2 * n, 2 * n, 4 * n)
    assert m.trainable_params == n
    # The peak is the largest of three moments, each holding some of the parts: no
    # gradients through the loss of a one-forward step, all but the untied input
    # embedding's in a layer's backward, AdamW's foreach temporaries (one of every weight on
    # a GPU) in the update.
    static = m.parameters + m.optimizer
    embedding = LLAMA3_8B.vocab_size * LLAMA3_8B.hidden_size * 2
    assert (m.loss_gradients, m.late_gradients, m.update_temporaries) == (0, embedding, 2 * n)
    assert dict(m.moments()) == {
        "the loss": static + m.activations + m.logits,
        "a decoder layer's backward": static + m.gradients - embedding + m.activations
        + m.recompute + m.attention_buffers,
        "the optimizer update": static + m.gradients + m.update_temporaries}
    assert m.total == max(dict(m.moments()).values())
    accumulating = _memory(gradient_accumulation_steps=2)
    assert accumulating.loss_gradients == m.gradients


def test_memory_sgd_has_no_optimizer_state():
    assert _memory(optimizer="sgd").optimizer == 0


def test_memory_lora_trains_only_adapters():
    m = _memory(adapter="lora", lora_r=16, lora_target_modules="all-linear")
    lora, unmatched = lora_parameter_count(
        cfg(adapter="lora", lora_r=16, lora_target_modules="all-linear"), LLAMA3_8B
    )
    assert unmatched == []
    assert lora == 16 * 32 * (4096 + 4096 + 2 * (4096 + 1024) + 4096 + 4096
                             + 3 * (4096 + 14336))
    assert m.trainable_params == lora
    assert (m.gradients, m.optimizer) == (4 * lora, 8 * lora)  # fp32 adapters
    assert m.parameters == 2 * LLAMA3_8B.parameter_count() + 4 * lora


def test_memory_lora_unknown_module_is_noted():
    config = cfg(adapter="lora", lora_target_modules=["q_proj", "qkv"])
    _, notes = _estimate(config, LLAMA3_8B, 1)
    assert any("'qkv'" in n for n in notes)


def test_memory_fsdp_divides_by_world():
    plain, sharded = _memory(), _memory(fsdp=True)
    assert sharded.gradients == plain.gradients // 8
    assert sharded.optimizer == plain.optimizer // 8
    assert plain.parameters // 8 < sharded.parameters < plain.parameters // 4


def test_memory_gradient_checkpointing_lowers_activations():
    assert _memory(gradient_checkpointing=True).activations < _memory().activations / 8


def test_memory_activations_scale_with_tokens_per_rank():
    assert _memory(sp=4, world=4).activations == 2 * _memory(sp=8).activations


def test_memory_fused_loss_holds_one_block_of_logits():
    """A plain head's loss is fused: one 64 MiB float32 block of logits (+ its bf16 source),
    the head's float32 weight gradient and three hidden-size tensors (the decoder's output,
    the final norm's, their gradient), never the shard's [tokens, vocab] logits (8192 local
    tokens here)."""
    vocab, hidden, tokens = LLAMA3_8B.vocab_size, LLAMA3_8B.hidden_size, 8192
    block = 64 * 2**20 // (4 * vocab)
    fused = _memory()
    assert fused.logits == block * vocab * 6 + 4 * vocab * hidden + 3 * tokens * hidden * 2
    chunked = _memory(chunked_loss=True, loss_chunk_size=1024)
    assert chunked.logits == 1024 * vocab * 6 + 4 * vocab * hidden + 3 * tokens * hidden * 2
    # A LoRA run trains no head weight: no head gradient.
    lora = _memory(adapter="lora", lora_target_modules=["q_proj"])
    assert lora.logits == fused.logits - 4 * vocab * hidden


@pytest.mark.parametrize("overrides", [
    {"fsdp": True}, {"dtype": "float16"},
    {"adapter": "lora", "lora_target_modules": ["q_proj", "lm_head"]},
    {"adapter": "lora", "lora_target_modules": ["q_proj"], "lora_modules_to_save": ["lm_head"]},
])
def test_memory_other_heads_hold_the_shard_logits_unless_chunked(overrides):
    b = 2  # bf16 / fp16 logits, then two float32 copies
    full = _memory(**overrides)
    assert full.logits == 8192 * LLAMA3_8B.vocab_size * (b + 8)
    chunked = _memory(chunked_loss=True, loss_chunk_size=1024, **overrides)
    assert chunked.logits * 8 == full.logits  # 8192 local tokens vs chunks of 1024


def test_memory_ring_buffers_scale_with_heads_k_stride():
    one, four = _memory(heads_k_stride=1), _memory(heads_k_stride=4)
    assert four.attention_buffers == 4 * one.attention_buffers
    # K,V double-buffered + dK,dV for one KV head of 128 dims over 65536 tokens, bf16.
    assert one.attention_buffers == 6 * 128 * 65536 * 2
    assert _memory(sp=1, world=1).attention_buffers == 0


def test_memory_checkpointing_counts_logits_and_recompute_at_different_moments():
    m = _memory(gradient_checkpointing=True)
    assert m.recompute > 0
    moments = dict(m.moments())
    assert moments["a decoder layer's backward"] - moments["the loss"] == (
        m.gradients - m.late_gradients + m.recompute + m.attention_buffers - m.logits)
    # Kept: each layer's input, [tokens, hidden] per layer (8192 local tokens, bf16).
    assert m.activations == 32 * 4096 * 8192 * 2


def test_memory_tiled_mlp_drops_four_intermediates_per_layer():
    plain, tiled = _memory(), _memory(tiled_mlp=True)
    assert plain.activations - tiled.activations == 32 * 4 * 14336 * 8192 * 2
    # Default tiles of ~hidden tokens: one tile (4096 tokens of 8192) is live in backward,
    # beside the attention backward's buffers and the residual gradients on a GPU.
    gpu_backward = 8192 * (4096 * (2 * 2 + 4) + 2 * 4096 * 2 + 2 * 4096 * 2)
    assert tiled.recompute == 4 * 14336 * 4096 * 2 + gpu_backward
    assert _memory(tiled_mlp=True, tiled_mlp_tiles=8192).recompute == (
        4 * 14336 * 2 + gpu_backward)


@pytest.mark.parametrize("plain", [
    {"shape": replace(LLAMA3_8B, model_type="gemma")},  # Gemma's norm: 1 + weight
    {"trust_remote_code": True},  # remote code may bring its own norm
])
def test_memory_lean_norm_keeps_no_float32_copies(plain):
    """A Llama-style model's norms are lean in training (runtime/memory_savers.py): below
    float32 a layer saves no float32 copy of either norm's input (2 x hidden x 4 bytes per
    token), in every layer kept or in the one recomputed with checkpointing."""
    lean, other = _memory(), _memory(**plain)
    assert other.activations - lean.activations == 32 * 2 * 4096 * 4 * 8192
    gc = _memory(gradient_checkpointing=True)
    gc_other = _memory(gradient_checkpointing=True, **plain)
    assert gc_other.recompute - gc.recompute == 2 * 4096 * 4 * 8192
    assert gc_other.activations == gc.activations  # the kept layer inputs
    # float32 training saves no float32 copies either way.
    assert (_memory(dtype="float32", **plain).activations
            == _memory(dtype="float32").activations)


def test_memory_lean_norm_is_not_applied_under_tp():
    from longctx_cli.config.memory_estimate import lean_norm

    config = cfg(sequence_len=65536)
    assert lean_norm(config, LLAMA3_8B) and not lean_norm(config, LLAMA3_8B, tp=2)


def test_memory_offload_frees_device_memory_but_not_host_memory():
    gc = _memory(gradient_checkpointing=True)
    offload = _memory(gradient_checkpointing=True, activation_offloading=True)
    backward = "a decoder layer's backward"  # the update's moment (the peak here) holds none
    assert offload.activations == 0
    assert dict(offload.moments())[backward] < dict(gc.moments())[backward]
    config = cfg(sequence_len=65536, sequence_parallel_degree=8, gradient_checkpointing=True,
                 activation_offloading=True)
    on_cpu, notes = _estimate(config, LLAMA3_8B, 8, host_is_device=True)
    gc_on_cpu = _estimate(cfg(sequence_len=65536, sequence_parallel_degree=8,
                              gradient_checkpointing=True), LLAMA3_8B, 8, host_is_device=True)
    assert on_cpu.total == gc_on_cpu[0].total
    assert any("frees nothing" in n for n in notes)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 1024**3), ("80G", 80 * 1024**3), ("24GB", 24 * 10**9),
     ("512 MiB", 512 * 1024**2), ("1.5GiB", int(1.5 * 1024**3)), ("4096", 4096)],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-3GiB", "80 parsecs", "0"])
def test_parse_memory_size_rejects(text):
    with pytest.raises(UserError, match="--memory-per-rank"):
        parse_memory_size(text)


def test_smallest_fitting_sp_is_the_first_legal_degree_under_the_limit():
    config = cfg(sequence_len=131072, sequence_parallel_degree=1)
    totals = {
        sp: _estimate(config.model_copy(update={"sequence_parallel_degree": sp}),
                      LLAMA3_8B, 8)[0].total
        for sp in (1, 2, 4, 8)
    }
    limit = (totals[4] + totals[2]) // 2
    best, tried = smallest_fitting_sp(config, LLAMA3_8B, 8, limit)
    assert best is not None and best.sp == 4 and best.total == totals[4]
    assert [f.sp for f in tried] == [1, 2, 4]
    # Beyond the world: an 8-rank launch learns that 16 ranks would be needed.
    best, tried = smallest_fitting_sp(config, LLAMA3_8B, 8, totals[8] - 1)
    assert best is not None and best.sp == 16


def test_smallest_fitting_sp_skips_illegal_degrees():
    config = cfg(sequence_len=4096 * 3, sequence_parallel_mode="ulysses")
    best, tried = smallest_fitting_sp(config, LLAMA3_8B, 8, 10**15)
    assert best is not None and best.sp == 1
    best, tried = smallest_fitting_sp(config, LLAMA3_8B, 8, 1)
    assert best is None
    by_sp = {f.sp: f for f in tried}
    assert by_sp[64].total is None  # 32 heads cannot be split over 64 Ulysses ranks


def test_offload_without_checkpointing_is_noted():
    notes = plan(activation_offloading=True).notes
    assert any("without gradient_checkpointing" in n for n in notes)
    assert not any("without gradient_checkpointing" in n for n in
                   plan(activation_offloading=True, gradient_checkpointing=True).notes)


SEED_OSS_LIKE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "vocab_size": 128, "attention_dropout": 0.1}


def test_attention_dropout_is_applied_at_sp1_and_by_ulysses():
    config = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte")
    notes = build_plan(config, 1, read_model_config(config), platform=CPU).notes
    assert any(n.startswith("attention dropout (attention_dropout = 0.1) in training, as the "
                            "model applies it") for n in notes), notes
    ulysses = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", sequence_parallel_degree=2,
                  sequence_parallel_mode="ulysses")
    assert build_plan(ulysses, 2, read_model_config(ulysses), platform=CPU).layout.sp == 2
    gpu = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0))
    fused = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", dtype="bfloat16",
                attention_kernel="torch_flash")
    notes = build_plan(fused, 1, read_model_config(fused), platform=gpu).notes
    assert any("PyTorch's flash op's dropout_p" in n for n in notes), notes


def test_attention_dropout_is_refused_on_a_ring_and_overrides_of_model_config_turn_it_off():
    config = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", sequence_parallel_degree=2)
    with pytest.raises(UserError) as exc:
        build_plan(config, 2, read_model_config(config), platform=CPU)
    msg = str(exc.value)
    assert msg.startswith("sequence_parallel_mode: `sequence_parallel_mode: ring` at sp 2 "
                          "cannot apply the model's attention_dropout = 0.1"), msg
    assert "`overrides_of_model_config: {attention_dropout: 0.0}`" in msg
    assert "Fix: set `sequence_parallel_mode: ulysses`." in msg
    hybrid = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", sequence_parallel_degree=4,
                 sequence_parallel_mode="hybrid", ulysses_degree=2)
    with pytest.raises(UserError, match="`sequence_parallel_mode: hybrid` at sp 4"):
        build_plan(hybrid, 4, read_model_config(hybrid), platform=CPU)
    fixed = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", sequence_parallel_degree=2,
                overrides_of_model_config={"attention_dropout": 0.0})
    shape = read_model_config(fixed)
    assert shape.config_value("attention_dropout") == 0.0
    plan_fixed = build_plan(fixed, 2, shape, platform=CPU)
    assert not any("attention dropout" in n for n in plan_fixed.notes)
    from longctx_cli.runtime.model import model_config_of

    assert model_config_of(fixed).attention_dropout == 0.0  # what the ranks build


def test_attention_dropout_is_refused_with_tp_and_prefix_sharing():
    config = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte", tensor_parallel_size=2)
    with pytest.raises(UserError) as exc:
        build_plan(config, 2, read_model_config(config), platform=CPU)
    assert str(exc.value).startswith("tensor_parallel_size: `tensor_parallel_size` = 2 cannot "
                                     "apply the model's attention_dropout = 0.1")
    from longctx_cli.config.sections.model import check_attention_dropout

    plain = cfg(model_config=SEED_OSS_LIKE, tokenizer="byte")
    layout = build_plan(plain, 1, read_model_config(plain), platform=CPU).layout
    shape = read_model_config(plain)
    assert isinstance(shape, ModelShape)
    with pytest.raises(UserError) as exc:
        check_attention_dropout(shape, layout, prefix_sharing=True)
    assert str(exc.value).startswith("prefix_sharing: `prefix_sharing: true` cannot run with "
                                     "the model's attention_dropout = 0.1")


def test_router_aux_loss_is_refused_and_overrides_of_model_config_turn_it_off():
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "vocab_size": 64, "output_router_logits": True,
           "router_aux_loss_coef": 0.01}
    # The refusal is true: the model's own training loss carries the router loss.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**moe))
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        with_aux = model(ids, labels=ids).loss
        model.config.output_router_logits = False
        assert abs(float(with_aux - model(ids, labels=ids).loss)) > 1e-4
    config = cfg(model_config=moe, tokenizer="byte")
    with pytest.raises(UserError) as exc:
        build_plan(config, 1, read_model_config(config), platform=CPU)
    msg = " ".join(str(exc.value).split())
    assert msg.startswith("overrides_of_model_config: the model's config has "
                          "output_router_logits: true"), msg
    assert "Fix: add `overrides_of_model_config: {output_router_logits: false}`" in msg
    fixed = cfg(model_config=moe, tokenizer="byte",
                overrides_of_model_config={"output_router_logits": False})
    assert build_plan(fixed, 1, read_model_config(fixed), platform=CPU).layout.kernel == "torch"


def test_overrides_of_model_config_apply_to_a_saved_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.runtime.model import load_base_model

    hf = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=64, attention_dropout=0.1)
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "model")
    config = config_from_dict({"base_model": str(tmp_path / "model"), "tokenizer": "byte",
                               "dtype": "float32",
                               "overrides_of_model_config": {"attention_dropout": 0.0}})
    assert read_model_config(config).config_value("attention_dropout") == 0.0
    assert load_base_model(config, "sdpa").config.attention_dropout == 0.0
    plain = config.model_copy(update={"overrides_of_model_config": None})
    assert read_model_config(plain).config_value("attention_dropout") == 0.1


def test_memory_preference_counts_the_shards_logits():
    """A preference run scores every token of its shard at once (its pair losses need the
    per-token log-probabilities): its logits term is the unfused one, far above SFT's block."""
    from longctx_cli.config.memory_estimate import LOGITS_FP32_COPIES
    from longctx_cli.config.units import DTYPE_BYTES

    lora = {"adapter": "lora", "lora_target_modules": "all-linear", "dtype": "bfloat16"}
    pairs = {"rl": "dpo", "datasets": [{"path": "pairs.jsonl", "type": "chatml.intel"}]}
    sft, dpo = _memory(**lora), _memory(**lora, **pairs)
    per_token = LLAMA3_8B.vocab_size * (DTYPE_BYTES["bfloat16"] + 4 * LOGITS_FP32_COPIES)
    assert dpo.logits == 65536 // 8 * per_token
    assert dpo.logits > 10 * sft.logits


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "fa4"])
def test_validate_on_a_cpu_machine_plans_a_gpu_kernel_for_the_gpus(kernel):
    """`validate` from a login node (no CUDA) plans a GPU-only kernel for the run's GPUs,
    and says what it assumed, instead of refusing the kernel for this machine."""
    p = build_plan(cfg(attention_kernel=kernel, dtype="bfloat16"), 8, LLAMA3_8B,
                   platform=CPU, assume_gpu=True)
    assert p.layout.kernel == kernel
    assert any("this machine has no CUDA GPU; the plan assumes" in text
               for text in p.assumed), p.assumed


# ---- Ulysses head chunks ----------------------------------------------------------------


ULYSSES8 = {"sequence_parallel_degree": 8, "sequence_parallel_mode": "ulysses"}


def render(p: Plan) -> str:
    out = io.StringIO()
    Console(file=out, width=160).print(p.to_table())
    return out.getvalue()


@pytest.mark.parametrize(("sequence_len", "chunks"), [(65536, 1), (131072, 2), (262144, 4),
                                                      (1048576, 4)])
def test_plan_picks_the_fewest_head_chunks_under_the_target(sequence_len: int, chunks: int):
    """Llama-3-8B at sp 8: 4 heads a rank; a head-layout tensor of the whole row is 64 MiB
    at 64K tokens (bf16), so the plan chunks past that, up to the 4 chunks the 8 KV heads
    allow, and prints the count with one chunk's tensor size."""
    p = plan(8, LLAMA3_8B, sequence_len=sequence_len, bf16=True, **ULYSSES8)
    assert p.layout.head_chunks == chunks
    table = " ".join(render(p).split())
    assert f"ulysses head chunks │ {chunks} ({4 // chunks} head" in table


def test_head_chunks_shrink_the_planned_attention_buffers():
    # phi3 hands over v as a view of its fused projection: no spent q, k, v to write over.
    fused_qkv = replace(LLAMA3_8B, model_type="phi3")
    whole, chunked = (plan(8, fused_qkv, sequence_len=262144, bf16=True, **ULYSSES8,
                           **chunks).memory for chunks in ({"ulysses_head_chunks": 1}, {}))
    assert chunked.attention_buffers < whole.attention_buffers
    # Llama's spent q, k and v take the unchunked all-to-all's head layout: only the
    # attention output's is counted ([tokens per rank, heads, head dim], bf16).
    spent = plan(8, LLAMA3_8B, sequence_len=262144, bf16=True, ulysses_head_chunks=1,
                 **ULYSSES8).memory
    assert spent.attention_buffers == 262144 // 8 * LLAMA3_8B.q_dim * 2


def test_head_chunks_that_split_a_kv_group_are_refused_with_the_counts_that_fit():
    msg = rule_error(8, LLAMA3_8B, ulysses_head_chunks=3, **ULYSSES8)
    assert "`ulysses_head_chunks` = 3" in msg and "use one of 1, 2, 4" in msg


def test_head_chunks_outside_ulysses_are_refused():
    msg = rule_error(4, SMALL, sequence_parallel_degree=4, ulysses_head_chunks=2)
    assert "`ulysses_head_chunks` = 2" in msg and "ring's attention runs unchunked" in msg

"""The family matrix: each model family, with its features active, trains under longctx
exactly as the model's own Hugging Face training does -- at sp=1 and under every SP strategy,
hybrid Ulysses x ring, tensor parallelism and the ``torch_flash`` kernel.

The reference for every cell is the model's own training: `forward(labels=...)` one document
at a time, eager attention, the loss token-weighted over the step, the same optimizer. The
longctx side is what `longctx train` runs: the plan's rules (`build_plan`, as the launcher
checks them), the fidelity probe, then the trainer's own step (`build_model`, `shard_batch`,
`train_step`) on the plan's layout. Tiny models (hidden 32, 2 layers, vocab 128) on packed
rows of 62-64 tokens, windows of 8 tokens (shorter than most documents), softcaps of 1.0 and
scales far from 1, so every feature changes the loss (`activity` proves it per feature).

A column (`COLUMNS`) is one layout on a world of 1, 2 or 4 processes. A cell is "exact", or
"refused: <what the refusal says>" where longctx refuses the combination (`Column.refuses`).
The ``torch_flash`` kernel runs on CUDA in bf16/fp16 only: its columns are planned for that
machine (an H100, bf16) and computed here in fp32 on the CPU stand-in of PyTorch's flash op
(tests/torch_flash_standin.py, float64 math), which must be called.

`docs/families.md` is generated from this module (`python -m tests.family_matrix >
docs/families.md`); tests/test_family_matrix.py runs the matrix and checks the page is fresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-4
STEPS = 3
ACCUMULATION = 2
WINDOW = 8
LR = 0.01
# Document lengths of each packed row (one-token documents and windows crossing rank
# boundaries included); two rows per optimizer step.
ROWS = [(17, 1, 22, 24), (30, 9, 23), (12, 38, 12), (5, 26, 33), (1, 40, 21), (20, 20, 24)]

BASE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # logits and scores O(1): caps and scales visibly matter
}
# A Mamba2 mixer of 4 heads of 16 (2 x hidden), state 16, scan chunks of 8 tokens (shorter
# than most documents, so the scan carries its state across chunks).
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2, "mamba_d_state": 16,
          "mamba_n_groups": 1, "mamba_chunk_size": 8, "mamba_d_conv": 4}
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
ALL_FULL = ["full_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    name: str  # the matrix row
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    # feature -> the fields that switch it off (the reference must then differ)
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    always_on: tuple[str, ...] = ()  # features with no switch (e.g. learned sinks)
    # longctx config keys both trainings use (the row's cells say so), e.g. the
    # `overrides_of_model_config` that validate asks for, and why (the features column)
    settings: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # the config keys under which validate refuses the row without its settings
    refused_with: dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> dict[str, Any]:
        return {"model_type": self.model_type, **BASE, **self.fields, **overrides}


def _sliding(**extra: Any) -> dict[str, Any]:
    return {"sliding_window": WINDOW, **extra}


FAMILIES = [
    Family("llama", "llama"),
    Family("qwen2", "qwen2"),
    Family("qwen3", "qwen3", {"head_dim": 8}),
    Family("gemma", "gemma", {"head_dim": 8}),
    Family("olmo2", "olmo2"),
    Family("mistral", "mistral", _sliding(head_dim=8),
           {"sliding window": {"sliding_window": None}}),
    Family("phi3", "phi3", _sliding(pad_token_id=0),
           {"sliding window": {"sliding_window": None}}),
    Family("starcoder2", "starcoder2", _sliding(),
           {"sliding window": {"sliding_window": None}}),
    Family("mixtral", "mixtral", _sliding(num_local_experts=4, num_experts_per_tok=2),
           {"sliding window": {"sliding_window": None}}),
    Family("qwen2 (use_sliding_window)", "qwen2",
           _sliding(use_sliding_window=True, max_window_layers=1, layer_types=SLIDING_THEN_FULL),
           {"per-layer sliding window": {"use_sliding_window": False, "layer_types": ALL_FULL}}),
    Family("qwen3 (use_sliding_window)", "qwen3",
           _sliding(head_dim=8, use_sliding_window=True, max_window_layers=1,
                    layer_types=SLIDING_THEN_FULL),
           {"per-layer sliding window": {"use_sliding_window": False, "layer_types": ALL_FULL}}),
    Family("olmo3", "olmo3", _sliding(layer_types=SLIDING_THEN_FULL),
           {"per-layer sliding window": {"layer_types": ALL_FULL}}),
    Family("cohere2", "cohere2", _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL,
                                          logit_scale=0.25),
           {"per-layer sliding window": {"layer_types": ALL_FULL},
            "logit_scale": {"logit_scale": 1.0}}),
    Family("gemma2", "gemma2",
           _sliding(head_dim=8, query_pre_attn_scalar=8, layer_types=SLIDING_THEN_FULL,
                    attn_logit_softcapping=1.0, final_logit_softcapping=1.0),
           {"per-layer sliding window": {"layer_types": ALL_FULL},
            "attention softcap": {"attn_logit_softcapping": None},
            "final logit softcap": {"final_logit_softcapping": None}}),
    Family("gemma3_text", "gemma3_text",
           _sliding(head_dim=8, query_pre_attn_scalar=8, layer_types=SLIDING_THEN_FULL,
                    final_logit_softcapping=1.0),
           {"per-layer sliding window": {"layer_types": ALL_FULL},
            "final logit softcap": {"final_logit_softcapping": None}}),
    Family("granite", "granite",
           {"logits_scaling": 4.0, "attention_multiplier": 0.5, "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5},
           {"logits_scaling": {"logits_scaling": 1.0},
            "attention/embedding/residual multipliers": {
                "attention_multiplier": 8**-0.5, "embedding_multiplier": 1.0,
                "residual_multiplier": 1.0}}),
    Family("cohere", "cohere", {"logit_scale": 0.25}, {"logit_scale": {"logit_scale": 1.0}}),
    Family("gpt_oss", "gpt_oss",
           _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL, num_local_experts=4,
                    num_experts_per_tok=2),
           {"per-layer sliding window": {"layer_types": ALL_FULL}},
           always_on=("attention sinks", "MoE")),
    Family("qwen3_moe", "qwen3_moe",
           {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32}, always_on=("MoE",)),
    Family("glm4", "glm4", {"head_dim": 8, "partial_rotary_factor": 0.5, "pad_token_id": 0},
           {"partial rotary": {"partial_rotary_factor": 1.0}}),
    Family("phi", "phi", {"partial_rotary_factor": 0.5},
           {"partial rotary": {"partial_rotary_factor": 1.0}}, always_on=("parallel block",)),
    Family("smollm3", "smollm3", {"no_rope_layers": [1, 0], "pad_token_id": 0},
           {"NoPE layer": {"no_rope_layers": [1, 1]}}),
    Family("exaone4", "exaone4", _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL),
           {"per-layer sliding window": {"layer_types": ALL_FULL}}),
    # Multi-head latent attention: q/k head dim 12 + 4 (no rotary, rotary), values 8 (the
    # flash kernels pad them to 16; q/k must be a flash head dim, a multiple of 8); low-rank
    # q and kv projections; every head has its own k (kv heads = heads); layer 0 dense,
    # layer 1 MoE with group-limited routing (2 groups of 2 experts, 1 group chosen).
    Family("deepseek_v3", "deepseek_v3",
           {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_shared_experts": 1},
           always_on=("latent attention (q/k head dim 16, v head dim 8)", "MoE")),
    # Chunks of WINDOW tokens from each document's start on the RoPE layer, a NoPE layer with
    # full attention (the NoPE layers' temperature tuning starts at floor_scale 8192 tokens:
    # tests/test_temperature_tuning.py checks it on rows that reach it).
    Family("llama4_text", "llama4_text",
           {"head_dim": 8, "attention_chunk_size": WINDOW, "no_rope_layers": [1, 0],
            "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64},
           {"chunked attention": {"attention_chunk_size": 8192},
            "NoPE layer": {"no_rope_layers": [1, 1],
                           "layer_types": ["chunked_attention", "full_attention"]}},
           always_on=("MoE",)),
    # Hybrids: layers that mix tokens outside attention (parallel/token_mixing.py) beside
    # attention layers. LFM2: short causal convolutions (kernel 3), then attention.
    Family("lfm2", "lfm2", {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3},
           {"short convolution layer": {"layer_types": ALL_FULL}}),
    # Qwen3-Next: a gated delta-net layer (causal conv + linear-attention scan), then
    # attention with an output gate; MoE with a shared expert.
    Family("qwen3_next", "qwen3_next",
           {"head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
           {"gated delta-net layer": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    # OLMo hybrid: a gated delta-net layer (negative eigenvalues allowed), then attention.
    Family("olmo_hybrid", "olmo_hybrid",
           {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
            "linear_num_value_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 16, "pad_token_id": 0, "eos_token_id": 1},
           always_on=("gated delta-net layer",)),  # its config refuses all-attention
    # Falcon-H1: a Mamba2 mixer (conv + SSM scan) beside attention in every layer.
    Family("falcon_h1", "falcon_h1",
           {"head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
            "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16,
            "mamba_d_conv": 4},
           always_on=("Mamba2 beside attention",)),
    # Bamba and Granite 4.0-H: Mamba2 layers (conv + SSM scan), then
    # attention; Granite with MoE.
    Family("bamba", "bamba", {**MAMBA2, "attn_layer_indices": [1]},
           {"Mamba2 layer": {"attn_layer_indices": [0, 1]}}),
    Family("granitemoehybrid", "granitemoehybrid",
           {**MAMBA2, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
            "num_experts_per_tok": 2},
           {"Mamba2 layer": {"layer_types": ["attention", "attention"]}}, always_on=("MoE",)),
    # Nemotron-H: a Mamba2 layer, an attention layer and an MLP layer (its blocks each hold
    # one kind; the layer count is the length of the list).
    Family("nemotron_h", "nemotron_h",
           {"mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1,
            "chunk_size": 8, "conv_kernel": 4, "head_dim": 8, "num_hidden_layers": 3,
            "layers_block_type": ["mamba", "attention", "mlp"]},
           {"Mamba2 layer": {"layers_block_type": ["attention", "attention", "mlp"]}}),
    # Zamba2: Mamba2 in every layer; a hybrid layer also runs the shared attention block
    # (one set of weights for all such layers) on the hidden states and the embeddings.
    Family("zamba2", "zamba2",
           {"n_mamba_heads": 4, "mamba_headdim": 16, "mamba_d_state": 16, "mamba_ngroups": 1,
            "chunk_size": 8, "mamba_d_conv": 4, "mamba_expand": 2, "num_key_value_heads": 4,
            "layers_block_type": ["mamba", "hybrid"]},
           always_on=("Mamba2 layers", "shared attention block")),
    # Jamba: a Mamba layer (selective scan; it takes no starting state, so every sharding
    # reruns document prefixes), then attention with experts.
    Family("jamba", "jamba",
           {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
            "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
            "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8},
           {"Mamba layer": {"attn_layer_period": 1, "attn_layer_offset": 0}},
           always_on=("MoE",)),
    # ---- the families of 2026 that Axolotl's examples train --------------------------------
    # Qwen3.5: gated delta-net layers (conv + linear-attention scan), then attention with an
    # output gate and partial rotary; dense and MoE with a shared expert.
    Family("qwen3_5_text", "qwen3_5_text",
           {"head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8},
           {"gated delta-net layer": {"layer_types": ALL_FULL}}),
    Family("qwen3_5_moe_text", "qwen3_5_moe_text",
           {"head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
           {"gated delta-net layer": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    # Gemma 4: sliding layers of head dim 8, full-attention layers of head dim 16 (its
    # per-layer config), keys as values on the full layers, per-layer input embeddings, and
    # the last two layers reusing the first two's keys and values.
    Family("gemma4_text", "gemma4_text",
           _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL * 2,
                    num_hidden_layers=4, per_layer_config={"1": {"head_dim": 16},
                                                           "3": {"head_dim": 16}},
                    attention_k_eq_v=True, num_kv_shared_layers=2,
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                    final_logit_softcapping=1.0),
           {"keys as values (attention_k_eq_v)": {"attention_k_eq_v": False},
            "KV sharing": {"num_kv_shared_layers": 0},
            "final logit softcap": {"final_logit_softcapping": None}},
           always_on=("sliding window on layers 0 and 2",
                      "wider full-attention heads (per_layer_config)",
                      "per-layer input embeddings")),
    # Gemma 4 26B-A4B: experts beside the dense MLP in every layer, no per-layer inputs.
    Family("gemma4_text (MoE)", "gemma4_text",
           _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL, enable_moe_block=True,
                    num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                    hidden_size_per_layer_input=0, per_layer_config=None),
           {"per-layer sliding window": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    # Gemma 3n: AltUp streams, LAuReL, per-layer inputs, activation sparsity (each token keeps
    # its top 5% of MLP units: the MLP is wide so rounding moves few across the cutoff),
    # and KV sharing.
    Family("gemma3n_text", "gemma3n_text",
           _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL * 2, num_hidden_layers=4,
                    intermediate_size=[1024] * 4, num_kv_shared_layers=2,
                    activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                    laurel_rank=8, altup_num_inputs=2, final_logit_softcapping=1.0,
                    # The rows' SP padding is token 0: random weights keep the embedding's
                    # padding row at zero, where AltUp's magnitude (a square root) has no
                    # gradient; a trained checkpoint's padding row is not zero.
                    pad_token_id=3),
           {"per-layer sliding window": {"layer_types": ALL_FULL * 2},
            "activation sparsity": {"activation_sparsity_pattern": [0.0] * 4},
            "KV sharing": {"num_kv_shared_layers": 0}},
           always_on=("AltUp", "LAuReL", "per-layer input embeddings")),
    # Kimi Linear: Kimi delta attention (conv + linear-attention scan), then multi-head latent
    # attention; MoE after a dense layer.
    Family("kimi_linear", "kimi_linear",
           {"layer_types": ["linear_attention", "full_attention"], "linear_num_heads": 4,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "linear_head_dim": 8, "num_key_value_heads": 4, "kv_lora_rank": 16,
            "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 12,
            "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
            "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"]},
           {"Kimi delta attention layer": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    Family("minimax_m2", "minimax_m2",
           {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
           always_on=("MoE",)),
    # GLM-4.5 (partial rotary, a dense layer, then MoE with a shared expert) and GLM-4.7
    # Flash (multi-head latent attention with interleaved rotary).
    Family("glm4_moe", "glm4_moe",
           {"head_dim": 8, "partial_rotary_factor": 0.5, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1},
           {"partial rotary": {"partial_rotary_factor": 1.0}}, always_on=("MoE",)),
    Family("glm4_moe_lite", "glm4_moe_lite",
           {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "mlp_layer_types": ["dense", "sparse"]},
           always_on=("latent attention (q/k head dim 16, v head dim 8)", "MoE")),
    Family("deepseek_v2", "deepseek_v2",
           {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1},
           always_on=("latent attention (q/k head dim 16, v head dim 8)", "MoE")),
    # Mistral 3/4: Ministral's sliding window on every layer, Mistral 4's latent attention
    # and MoE with YaRN.
    Family("ministral", "ministral", _sliding(head_dim=8, layer_types=["sliding_attention"] * 2),
           {"sliding window": {"layer_types": ALL_FULL}}),
    # Ministral 3 (the text model of Mistral 3): YaRN-scaled RoPE.
    Family("ministral3", "ministral3", {"head_dim": 8, "pad_token_id": 0}),
    # Mistral 3 (Mistral Small 3.1, Ministral 3, Magistral, Mistral Medium 3.5) on text:
    # its own Mistral3ForConditionalGeneration (a Pixtral tower, never called on text) around
    # a Ministral 3 language model.
    Family("mistral3 (text rows)", "mistral3",
           {"text_config": {"model_type": "ministral3", **BASE, "head_dim": 8,
                            "pad_token_id": 0},
            "vision_config": {"hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 2,
                              "head_dim": 8, "image_size": 32, "patch_size": 8}},
           always_on=("a Pixtral vision tower and projector beside the text model",)),
    # Voxtral on text: its own VoxtralForConditionalGeneration (a Whisper-style audio tower,
    # never called on text) around a Llama language model.
    Family("voxtral (text rows)", "voxtral",
           {"text_config": {"model_type": "llama", **BASE},
            "audio_config": {"hidden_size": 16, "intermediate_size": 32,
                             "num_hidden_layers": 1, "num_attention_heads": 2,
                             "num_mel_bins": 8, "max_source_positions": 16}},
           always_on=("an audio tower and projector beside the text model",)),
    Family("mistral4", "mistral4",
           {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1},
           always_on=("latent attention (q/k head dim 16, v head dim 8)", "MoE")),
    Family("apertus", "apertus", {"head_dim": 8}, always_on=("xIELU activation",)),
    Family("arcee", "arcee", {"head_dim": 8}, always_on=("ReLU-squared MLP",)),
    Family("seed_oss", "seed_oss", {"head_dim": 8, "attention_bias": True,
                                    "attention_dropout": 0.0, "residual_dropout": 0.0},
           always_on=("attention biases",)),
    Family("hunyuan_v1_dense", "hunyuan_v1_dense", {"head_dim": 8},
           always_on=("q/k norms",)),
    Family("nemotron", "nemotron", {"head_dim": 8, "partial_rotary_factor": 0.5},
           {"partial rotary": {"partial_rotary_factor": 1.0}}),
    Family("lfm2_moe", "lfm2_moe",
           {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1},
           {"short convolution layer": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    # Trinity (AFMoE): sliding layers, then global attention; MoE after a dense layer.
    Family("afmoe", "afmoe",
           _sliding(head_dim=8, layer_types=SLIDING_THEN_FULL, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1,
                    global_attn_every_n_layers=2),
           {"per-layer sliding window": {"layer_types": ALL_FULL}}, always_on=("MoE",)),
    # MiMo-V2-Flash: sliding and full layers, values of their own head dim, scaled values.
    Family("mimo_v2_flash", "mimo_v2_flash",
           _sliding(head_dim=8, v_head_dim=4, layer_types=["full_attention", "sliding_attention"],
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    mlp_layer_types=["dense", "sparse"], attention_value_scale=0.707),
           {"per-layer sliding window": {"layer_types": ALL_FULL}},
           always_on=("value head dim 4", "MoE")),
    # Attention dropout: sp 1 and Ulysses apply it (tests/test_attention_dropout.py); a ring
    # cannot, so validate refuses the model there and names the override, which both
    # trainings here use (two trainings draw different masks).
    Family("llama (attention_dropout 0.1)", "llama", {"attention_dropout": 0.1},
           settings={"overrides_of_model_config": {"attention_dropout": 0.0}},
           note="attention dropout 0.1: sp 1 and Ulysses train with it as the model does; "
                "a ring sp2 is refused in one paragraph naming the override, which these "
                "trainings use", refused_with={"sequence_parallel_degree": 2}),
    # (Last: new rows keep the earlier rows' rotating columns.) No attention layer at all:
    # Mamba2 (its scan passes its state from rank to rank) and
    # Mamba / Falcon-Mamba (their selective scan takes no starting state: every rank reruns
    # the prefix of each document it holds part of). Their rows are split into contiguous
    # shards (zigzag where a column names it); no ring, attention kernel or head split runs.
    Family("mamba", "mamba", {"state_size": 16, "time_step_rank": 8, "conv_kernel": 4},
           always_on=("Mamba layers only (no attention)",)),
    Family("mamba2", "mamba2",
           {"num_heads": 4, "head_dim": 16, "state_size": 16, "n_groups": 1, "chunk_size": 8,
            "conv_kernel": 4},
           always_on=("Mamba2 layers only (no attention)",)),
    Family("falcon_mamba", "falcon_mamba",
           {"state_size": 16, "time_step_rank": 8, "conv_kernel": 4},
           always_on=("Mamba layers only (no attention)", "RMS-normed B, C and dt")),
]

def _tp_refusal(family: Family) -> str | None:
    """What validate says of a family that TP-sp cannot shard (config/sections/parallel.py)."""
    from longctx_cli.families import TP_FAMILIES

    # A multimodal row's refusal names its language model, the decoder TP-sp would shard.
    decoder = family.fields.get("text_config", {}).get("model_type", family.model_type)
    return None if decoder in TP_FAMILIES else f"model type `{decoder}` is not supported"


def _attention_free(family: Family) -> bool:
    """A row without any attention layer (families.Family.attention_free)."""
    from longctx_cli.families import family as family_record

    return family_record(family.model_type).attention_free


def _no_attention_refusal(what: str) -> Callable[[Family], str | None]:
    """A column that sets what only attention reads: refused for attention-free rows."""
    return lambda family: what if _attention_free(family) else None


NO_KERNEL = "has no attention layer for the kernel to compute"


@dataclass(frozen=True)
class Column:
    """One layout of the trainer on `world` processes; every family is trained under it."""

    name: str
    world: int
    settings: dict[str, Any] = field(default_factory=dict)  # the longctx config keys
    # The family -> what the refusal of this combination says (a part of its message), or
    # None where longctx trains it (then exactly).
    refuses: Callable[[Family], str | None] = lambda family: None
    slow: bool = False  # run by `pytest -m slow` only (docs/families.md shows every column)
    # By default every ROTATION-th family runs it (each family one rotating column), llama
    # every one; `pytest -m slow` runs the rest.
    rotating: bool = False

    @property
    def flash(self) -> bool:
        return self.settings.get("attention_kernel") == "torch_flash"


SP2 = {"sequence_parallel_degree": 2}
TORCH_FLASH = {"attention_kernel": "torch_flash"}
COLUMNS = [
    Column("sp1 vs the model", 1),
    Column("ring sp2", 2, {**SP2, "ring_attn_func": "varlen_llama3"}, rotating=True),
    Column("ring zigzag sp2", 2, {**SP2, "sp_sharding": "zigzag"}, rotating=True),
    Column("P2P stripe sp2 (default)", 2, SP2),
    Column("P2P ring sp2", 2, {**SP2, "ring_attn_func": "batch_ring"}, slow=True),
    Column("P2P zigzag sp2", 2, {**SP2, "ring_attn_func": "batch_zigzag"}, rotating=True),
    Column("Ulysses sp2", 2, {**SP2, "sequence_parallel_mode": "ulysses"}),
    # 4 query heads over 2 KV heads: 2 chunks of 1 KV head, replicated to both ranks.
    Column("Ulysses sp2, 2 head chunks", 2,
           {**SP2, "sequence_parallel_mode": "ulysses", "ulysses_head_chunks": 2},
           refuses=_no_attention_refusal("no heads to cut into chunks"), slow=True),
    Column("torch_flash ring sp2", 2, {**SP2, "ring_attn_func": "varlen_llama3", **TORCH_FLASH},
           refuses=_no_attention_refusal(NO_KERNEL), rotating=True),
    Column("torch_flash P2P stripe sp2", 2, {**SP2, **TORCH_FLASH},
           refuses=_no_attention_refusal(NO_KERNEL), slow=True),
    # 2 KV heads (4 in deepseek_v3): one (two) per Ulysses rank, no replication.
    Column("hybrid sp4 (Ulysses 2 x ring 2)", 4,
           {"sequence_parallel_degree": 4, "sequence_parallel_mode": "hybrid",
            "ulysses_degree": 2}, slow=True),
    Column("TP-sp tp2", 2, {"tensor_parallel_size": 2}, refuses=_tp_refusal, slow=True),
]
COLUMN = {c.name: c for c in COLUMNS}
ROTATING = [c.name for c in COLUMNS if c.rotating]


def runs_by_default(family: Family, column: Column) -> bool:
    """Whether the default run (not `-m slow`) has this cell: every family runs the
    columns not slow nor rotating, llama every column not slow, and each other family one
    rotating column, in turn down the table."""
    if column.slow:
        return False
    if not column.rotating or family.name == "llama":
        return True
    index = [f.name for f in FAMILIES].index(family.name)
    return ROTATING[index % len(ROTATING)] == column.name


def expected(family: Family, column: Column) -> str:
    """What the matrix asserts for a cell: "exact", or "refused: <part of the message>"."""
    reason = column.refuses(family)
    return "exact" if reason is None else f"refused: {reason}"


# ---- data ---------------------------------------------------------------------------------


def packed_row(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    docs = ROWS[index]
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(3, BASE["vocab_size"], (sum(docs),), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])
    labels = ids.clone()
    labels[pos == 0] = -100  # the data pipeline's convention: no target across documents
    return ids, pos, labels


def step_rows(step: int) -> list[int]:
    return list(range(step * ACCUMULATION, (step + 1) * ACCUMULATION))


def documents(index: int) -> list[torch.Tensor]:
    ids, _, _ = packed_row(index)
    return list(torch.split(ids, list(ROWS[index])))


# ---- the two trainings --------------------------------------------------------------------


def make_config(family: Family, overrides: dict[str, Any] | None = None, **model: Any):
    from longctx_cli.config import Config

    settings = {
        "dtype": "float32",
        "attention_kernel": "torch",
        "learning_rate": LR,
        # A parameter whose exact gradient is zero (a k_proj bias on dims without rotary:
        # softmax ignores a per-query shift) gets float noise of 1e-12; AdamW with eps 1e-8
        # would turn it into full-size steps of either sign, eps 1e-6 into nothing. Both
        # trainings use this optimizer; real gradients here are >= 1e-4.
        "adam_epsilon": 1e-6,
        "lr_scheduler": "constant",
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": STEPS,
        "seed": 7,
        **family.settings,
        **(overrides or {}),
    }
    return Config(model_config=family.config(**model), datasets=[{"path": "unused"}],
                  **settings)


def reference_training(family: Family) -> dict[str, Any]:
    """The model's own training: eager attention, forward(labels=) per document."""
    from longctx_cli.runtime.model import load_base_model
    from longctx_cli.train.optim import make_optimizer
    from tests.own_training import own_training

    config = make_config(family)
    model = load_base_model(config, "eager").train()
    optimizer = make_optimizer(config, [p for p in model.parameters() if p.requires_grad])
    steps = [[(d, None) for i in step_rows(step) for d in documents(i) if d.numel() > 1]
             for step in range(STEPS)]
    return own_training(model, optimizer, steps, config.training.max_grad_norm)


def feature_activity(family: Family) -> dict[str, float]:
    """Relative change of the first step's reference loss when each feature is switched off."""
    from longctx_cli.runtime.model import load_base_model

    def first_loss(model_overrides: dict[str, Any]) -> float:
        model = load_base_model(make_config(family, **model_overrides), "eager")
        docs = [d for i in step_rows(0) for d in documents(i) if d.numel() > 1]
        with torch.no_grad():
            parts = [model(input_ids=d[None], labels=d[None]).loss * (d.numel() - 1)
                     for d in docs]
        return float(sum(parts)) / sum(d.numel() - 1 for d in docs)

    on = first_loss({})
    return {name: abs(first_loss(off) - on) / on for name, off in family.features.items()}


# The machines the columns are planned for (`Platform` fields): this one, and for the
# torch_flash columns a CUDA GPU (where that kernel runs).
CPU = {"cuda": False, "ring_flash_attn": False}
H100 = {"cuda": True, "ring_flash_attn": False, "capability": (9, 0)}


def longctx_training(family: Family, overrides: dict[str, Any]) -> dict[str, Any]:
    """What `longctx train` runs, on this process group, with the layout `overrides` (a
    column's settings): the plan's rules (`build_plan`, on the launcher), the fidelity
    probe, then the trainer's step on the plan's layout (what `init_parallel` builds)."""
    import torch.distributed as dist

    from longctx_cli.checks.fidelity import check_fidelity
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.errors import UserError
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.model import build_model, decoder_and_head
    from longctx_cli.train.optim import make_optimizer
    from longctx_cli.train.step import train_step

    config = make_config(family, overrides)
    # torch_flash runs on CUDA in bf16/fp16 only: planned for that machine, computed here
    # in fp32 on the op's CPU stand-in (the worker points the kernel at it).
    flash = config.parallel.attention_kernel == "torch_flash"
    planned = config.model_copy(update={"dtype": "bfloat16"}) if flash else config
    try:
        plan = build_plan(planned, dist.get_world_size(), read_model_config(config),
                          platform=Platform(**(H100 if flash else CPU)))
        check_fidelity(config)
    except UserError as e:
        return {"refused": str(e)}
    state = build_parallel_state(plan.layout, torch.device("cpu"))
    model = build_model(config, state)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    losses = []
    for step in range(STEPS):
        batches = [shard_batch(*packed_row(i), state, 0) for i in step_rows(step)]
        result = train_step(model, decoder, head, params, optimizer, batches, config,
                            state, use_fsdp=False)
        losses.append(result.loss)
    weights = _weights(model)  # every rank: gathering TP shards is collective
    return {"losses": losses, "weights": weights if dist.get_rank() == 0 else None}


def _weights(model: torch.nn.Module) -> dict[str, Any]:
    # numpy arrays: pickled by value between processes (tensors would travel as shared
    # memory handles that die with the worker).
    # Each parameter once: tied input/output embeddings are one parameter (state_dict would
    # list it twice and count its difference twice). Buffers are not trained.
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in model.named_parameters()}
    return {k: v.detach().double().numpy().copy() for k, v in state.items()}


def compare(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Worst relative loss error over the steps; relative error of all final weights together."""
    if "refused" in run:
        return {"refused": run["refused"]}
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"],
                                                          strict=True))
    # One vector of all final weights: a per-tensor ratio is meaningless for tensors whose
    # exact gradient is zero (a k_proj bias: softmax ignores a per-query shift), where
    # AdamW turns float noise of order 1e-12 into full-size steps of either sign.
    diff_sq, want_sq, worst, worst_err = 0.0, 0.0, "", -1.0
    for key, want in reference["weights"].items():
        got, want_t = torch.from_numpy(run["weights"][key]), torch.from_numpy(want)
        diff_sq += float((got - want_t).pow(2).sum())
        want_sq += float(want_t.pow(2).sum())
        err = float((got - want_t).norm())
        if err > worst_err:
            worst_err, worst = err, key
    weight_err = (diff_sq / max(want_sq, 1e-60)) ** 0.5
    return {"loss": loss_err, "weights": weight_err, "worst_weight": worst,
            **{k: run[k] for k in ("flash_op_calls",) if k in run}}


# ---- workers (one process group per world size, every family in it) ----------------------


def sp1_worker(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """The references (the model's own training), feature activity and the sp1 column."""
    out = {}
    for family in FAMILIES:
        if family.name not in names:
            continue
        reference = reference_training(family)
        run = longctx_training(family, COLUMNS[0].settings)
        out[family.name] = {
            "reference": reference,
            "activity": feature_activity(family),
            COLUMNS[0].name: compare(run, reference),
        }
    return out


def columns_worker(rank: int, world_size: int,
                   cells: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """family -> column -> longctx's run (weights on rank 0), for these (family, column)
    cells of this world size; a torch_flash run also counts its calls of the flash op's
    stand-in."""
    from longctx_cli.parallel.torch_flash import use_flash_ops
    from tests import torch_flash_standin as standin

    use_flash_ops(standin.OPS)  # this process only; only the torch_flash kernel calls it
    out: dict[str, dict[str, Any]] = {}
    for family in FAMILIES:
        for column in [COLUMN[c] for f, c in cells if f == family.name]:
            assert column.world == world_size, (column, world_size)
            before = dict(standin.CALLS)
            run = longctx_training(family, column.settings)
            if column.flash:
                run["flash_op_calls"] = {k: n - before[k] for k, n in standin.CALLS.items()}
            out.setdefault(family.name, {})[column.name] = run
    return out


# ---- docs/families.md ---------------------------------------------------------------------


def render() -> str:
    """docs/families.md: which families and features are exact under which layouts."""
    from longctx_cli.families import TP_FAMILIES

    lines = [
        "# Model families",
        "",
        "<!-- generated by `python -m tests.family_matrix > docs/families.md`; "
        "do not edit -->",
        "",
        "longctx trains exactly what the model computes, or refuses before the first step. "
        "Each row below is a cell group of the CI matrix (`tests/test_family_matrix.py`): a "
        "tiny random model of the family with the listed features switched on and active at "
        "the tested length (windows of "
        f"{WINDOW} tokens inside packed rows of 62-64 tokens, softcaps of 1.0, scales far from "
        "1; the test proves each feature changes the loss), trained "
        f"{STEPS} optimizer steps (fp32, CPU, gloo) by the model's own Hugging Face training "
        "(`forward(labels=...)` per document, eager attention) and by longctx (the plan's "
        "rules as `longctx train` checks them, the fidelity probe, then the trainer's step on "
        "the plan's layout). **exact** means: per-step loss relative error < "
        f"{LOSS_TOL:g} and relative error of all final weights (one vector) < {WEIGHT_TOL:g} "
        "against the model's own training; *refused: ...* quotes the message `longctx "
        "validate` and `longctx train` stop with for that combination.",
        "",
        "The columns: one process (sp1); sequence parallelism over 2 ranks with each ring "
        "(llama3's all-gather ring `varlen_llama3` on contiguous and zigzag shards; the P2P "
        "rings `batch_stripe`, the default, `batch_ring` and `batch_zigzag`) and with Ulysses; "
        "the `torch_flash` kernel (PyTorch's own flash-attention op) under the llama3 ring and "
        "the default P2P stripe ring; hybrid over 4 ranks (`sequence_parallel_mode: hybrid`, "
        "`ulysses_degree: 2`: each Ulysses group of 2 ranks splits the heads, one of the 2 KV "
        "heads per rank in most rows, and llama3's ring, hybrid's default, runs across the 2 "
        "groups); TP-sp over 2 ranks (`tensor_parallel_size: 2`: Megatron-style tensor "
        "parallelism with "
        "sequence-sharded activations and a vocab-parallel loss). PyTorch's flash op runs on "
        "CUDA in bf16/fp16 only: the `torch_flash` columns are planned as `validate` plans a "
        "bf16 run on an H100, and trained in fp32 on a CPU stand-in of the op "
        "(`tests/torch_flash_standin.py`: the op's signature and conventions, float64 math); "
        "the test checks that the op was called. The columns "
        + ", ".join(f"*{c.name}*" for c in COLUMNS if c.slow)
        + " run with `pytest -m slow` (the suite's time budget), and so do the columns "
        + ", ".join(f"*{c}*" for c in ROTATING)
        + " except for llama and, for each other family, one of them in turn down the "
        "table; the rest in every run.",
        "",
        "A family that is not in this table is not assumed to work: before training (and in "
        "`longctx validate`) the *fidelity probe* builds a tiny random model of the user's "
        "family from its config and compares longctx's loss and gradients with the model's "
        "own forward; any difference beyond 1e-4 (or, for gradients alone, beyond 3x the "
        "model's own float noise, at most 1e-3: docs/parallelism.md) is refused with a message "
        "naming the model type and what differs (`fidelity_probe: false` skips it). When the "
        "probe cannot build or run its "
        "tiny copy of a family at all (its own shrinking, or the model's own forward on the "
        "tiny copy, fails), it says that it could not check the family, with the error's "
        "gist; `fidelity_probe: false` is then the way to train it, unverified.",
        "",
        "Vision-language models (Qwen2/2.5/3-VL, LLaVA, Gemma 3, Mistral 3, GLM-4.6V, "
        "PaddleOCR-VL, SmolVLM, InternVL, Llama 3.2 Vision with images) have their own "
        "table\nand tests: "
        "[docs/vlm.md](vlm.md#families).",
        "",
        "Hybrid models, whose decoder layers also mix tokens outside attention, are in the "
        "table where longctx covers their token-mixing layer (`parallel/token_mixing.py`): "
        "LFM2's short convolutions (`Lfm2ShortConv`), Qwen3-Next's and OLMo hybrid's gated "
        "delta-nets (`Qwen3NextGatedDeltaNet`, `OlmoHybridGatedDeltaNet`), the Mamba2 mixers of"
        " Falcon-H1, Bamba, Granite 4.0-H, Nemotron-H and Zamba2 (`FalconH1Mixer`, "
        "`BambaMixer`, `GraniteMoeHybridMambaLayer`, `NemotronHMamba2Mixer`, "
        "`Zamba2MambaMixer`) and Jamba's Mamba (`JambaMambaMixer`). Each runs the model's own "
        "module per document: a scan passes its state from rank to rank (on stripe rows, and "
        "always for Jamba's Mamba, which takes no starting state, it reruns each document's "
        "prefix), a convolution reads its kernel's halo from the rank before, so packed "
        "documents and rank boundaries change nothing; docs/parallelism.md says how and what it"
        " costs. The same layers in newer families are covered too and checked outside this "
        "table, by the fidelity probe (sp1 loss and gradients, `tests/test_fidelity.py`) and at"
        " sp2 against the model's own forward on contiguous and zigzag rows "
        "(`tests/test_token_mixing.py`): Qwen3.5 (`Qwen3_5GatedDeltaNet`), Kimi Linear "
        "(`KimiLinearDeltaAttention`), LaRA-mini (`LaraMiniGatedDeltaNet`), LFM3 and LFM2-MoE "
        "(`Lfm3ShortConv`, `Lfm2MoeShortConv`). Other hybrids (MiniMax's lightning attention, "
        "RecurrentGemma's recurrence) are refused by the probe, which names the layer "
        "(`tests/test_fidelity.py` checks minimax and recurrent_gemma).",
        "",
        "Models without any attention layer, Mamba, Mamba2 (Codestral Mamba) and Falcon-Mamba "
        "(`MambaMixer`, `Mamba2Mixer`, `FalconMambaMixer`), are rows too. Mamba2's scan passes "
        "its state from rank to rank; Mamba's and Falcon-Mamba's take no starting state, so "
        "each rank reruns the prefix of every document it holds part of. With no attention to "
        "compute, a column only decides how the row is split: these rows run contiguous shards "
        "in every SP column (the default, *P2P stripe sp2 (default)* and the Ulysses and hybrid "
        "columns included; a stripe would hand the state over at every token, and "
        "`sp_sharding: stripe` is refused) and zigzag shards where a column names zigzag; the "
        "torch_flash, head-chunk and TP columns are refused, each naming the key that has "
        "nothing to act on. RWKV and xLSTM, recurrences only, are refused by name: their "
        "state is not in the cache interface longctx hands a rank its starting state through.",
        "",
        "| family | features active in the test | "
        + " | ".join(c.name for c in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for family in FAMILIES:
        features = [*family.features, *family.always_on, *([family.note] if family.note
                                                             else [])]
        lines.append(
            f"| {family.name} (`{family.model_type}`) | {', '.join(features) or '-'} | "
            + " | ".join(_cell(expected(family, c), family) for c in COLUMNS) + " |"
        )
    lines += [
        "",
        "TP-sp shards the dense decoders " + ", ".join(TP_FAMILIES) + " from their "
        "transformers `base_model_tp_plan` (decoder layers of attention, MLP and norms only); "
        "`validate` refuses `tensor_parallel_size` > 1 for any other model type, with the fix "
        "`tensor_parallel_size: 1` (sequence parallelism + FSDP).",
        "",
        "Under `torch_flash`, softcapped attention (gemma2's `attn_logit_softcapping`) runs on "
        "the exact tiled matmul path, as `validate` says: PyTorch's flash op has no softcap; "
        "every other row's attention calls the op.",
        "",
        "Sliding windows come from each layer's `sliding_window` (per layer through "
        "`layer_types` / `max_window_layers`); the head's transforms (`logit_scale`, "
        "`logits_scaling`, `final_logit_softcapping`) are applied by longctx's loss and every "
        "evaluation (`longctx_cli/runtime/head.py`).",
        "",
        "Llama 4's chunked attention (`attention_chunk_size` on the layers whose `layer_types` "
        "entry is `chunked_attention`) counts chunks from each document's start, as the "
        "model's own forward over one document does; longctx cuts the row's segments at chunk "
        "starts, so every strategy and kernel computes it. Its NoPE layers' attention "
        "temperature tuning depends on the token's index in the forward's input and starts at "
        "`floor_scale` (8192) tokens, beyond the matrix's rows. The SP attention applies the "
        "scale of each token's index in its dataset row (the packed row; each row of a "
        "micro-batch), as the model's own training does: `tests/test_temperature_tuning.py` "
        "checks it on rows past a small `floor_scale`. Objectives that split a dataset row "
        "into several (`rl`, `reward_model`) are refused once a row reaches `floor_scale`.",
        "",
        "Multi-head latent attention (DeepSeek: q/k head dim `qk_nope_head_dim + "
        "qk_rope_head_dim`, values `v_head_dim`): the strategies carry each head dim as it is; "
        "the flash-attention ops (PyTorch's CPU and CUDA ops, flash-attn 2) take one head dim, "
        "so the smaller side is zero-padded inside each call (exact; `validate` notes the "
        "extra memory of the flash kernels).",
        "",
        "## How exactness is judged",
        "",
        "Both sides train in float32 and both round, so **exact** means equal within a bound: "
        f"per-step loss relative error < {LOSS_TOL:g} and relative error of all final weights "
        f"< {WEIGHT_TOL:g}. The reference is the model's own float32 training as a user runs "
        "it (`forward(labels=)`, whose loss is transformers' float32 `cross_entropy`), not a "
        "float64 recomputation, so the bounds must hold the reference's own rounding as well "
        "as longctx's. That rounding grows with the vocabulary: with a random head of a "
        "262,144-token vocabulary (Gemma 3's), 256 tokens and logits of std 3, PyTorch's float32 "
        "`cross_entropy` on CPU is 6.4e-7 to 6.9e-7 relative off the float64 sum, while "
        "longctx's fused loss stays within 1.2e-8 to 8.1e-8 of it (`python "
        "benchmarks/ce_precision.py`, 3 seeds; at 32,000 both are within 1.3e-7). "
        "The matrix's tiny models have a vocabulary of "
        f"{BASE['vocab_size']}, where that rounding is far below the bounds; the real-model "
        "test (`tests/test_real_model.py`: SmolLM2-135M, vocabulary 49,152, the default ring, "
        "`varlen_llama3` and Ulysses) holds `longctx train` to the same bounds against the "
        "model's own float32 training, its reference's cross-entropy in float32 too. A "
        "comparison with a loss bound near the reference's own rounding (a large vocabulary, "
        "long rows) would have to take the reference's cross-entropy in float64.",
        "",
        *_sweep_section(),
    ]
    return "\n".join(lines)


# Families Axolotl's examples name that longctx cannot train exactly, and why (the sweep's
# reason, which tests/test_family_sweep.py checks on each).
REFUSED_FAMILIES = (
    ("DeepSeek V3.2 and V4, GLM-5 (`glm_moe_dsa`)", "sparse attention: an indexer picks each "
     "query's top keys from the layer's full attention mask, which longctx's sequence-parallel "
     "attention neither builds nor computes"),
    ("MiniMax (`minimax`, MiniMax-Text-01)", "lightning attention layers, a linear-attention "
     "scan longctx does not pass across ranks (MiniMax-M2, `minimax_m2`, is exact)"),
    ("Vision-language families longctx does not rebuild (Llama 4's vision model, LFM2-VL)",
     "their towers, feature merge "
     "and positions are not rebuilt under sequence parallelism; their text models train "
     "where transformers has a causal LM of their own"),
    ("Gemma 4's both-ways images (`gemma4`) under a ring or hybrid, and its videos",
     "with `use_bidirectional_attention: vision` its image tokens attend both ways on its "
     "sliding-window layers, which a ring's ranks (each holding part of every document's "
     "keys) do not compute: refused, with the fix `sequence_parallel_mode: ulysses`. Its "
     "forward with images is exact at sp 1 and under Ulysses, and with causal images (the "
     "setting unset) under the rings too (tests/test_vlm_gemma4.py); its processor's rows "
     "are its own (tests/test_vlm_gemma4_data.py) and `longctx train` on them equals its "
     "own training (tests/test_vlm_train.py). Its videos (their own position ids and frame "
     "counts) and audio are refused. Its text, and its default config without towers, are "
     "exact"),
    ("Gemma 4 unified's images (`gemma4_unified`)", "no vision tower: raw patches with 2-D "
     "position ids are embedded straight into the text model, whose image tokens attend both "
     "ways; the VLM path computes neither (its text, and its default config, are exact)"),
    ("Gemma 3n's images and audio (`gemma3n`)", "a timm MobileNetV5 vision tower the probe "
     "cannot shrink, an audio tower, and no audio inputs in longctx; its language model "
     "(`gemma3n_text`) is exact"),
)


def _sweep_section() -> list[str]:
    """docs/families.md's summary of benchmarks/family_sweep.py (its newest results)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    runs = sorted(results.glob("family-sweep-*.json"))
    lines = ["## Refused, and why", "",
             "What Axolotl's examples train that longctx cannot train exactly:", "",
             "| family | why it is refused |", "|---|---|",
             *[f"| {name} | {why} |" for name, why in REFUSED_FAMILIES], ""]
    if not runs:
        return lines
    record = json.loads(runs[-1].read_text())
    return lines + [
        "## Every model type transformers knows", "",
        f"`python benchmarks/family_sweep.py` runs `longctx validate` on each model type of "
        f"transformers {record['transformers']}'s causal-LM and image-text-to-text mappings, "
        "on the family's own default config (the sizes and per-layer fields transformers "
        "gives it), one text dataset, one rank: every one is exact (the fidelity probe passed) "
        "or refused in one paragraph naming why, never a traceback. A model type transformers "
        "cannot build a config of, or whose own model class fails on its default config, is "
        f"listed apart (\"not built\"). Run {record['date']} on "
        f"{record['machine']} (`benchmarks/results/{runs[-1].name}`; the verdicts are "
        "deterministic)" + _rerun_text(record.get("rerun", {})) + ":", "",
        record["summary"], ""]


def _rerun_text(rerun: dict[str, str]) -> str:
    """`--update`'s reruns of single model types into the saved sweep (after a mend, or new
    in a later transformers), by date."""
    by_date: dict[str, list[str]] = {}
    for model_type, date in sorted(rerun.items()):
        by_date.setdefault(date, []).append(f"`{model_type}`")
    return "".join(f"; rerun {date}: {', '.join(types)}"
                   for date, types in sorted(by_date.items()))


def _settings_text(settings: dict[str, Any]) -> str:
    """`{key: value}` in YAML flow style, as a user writes it in the config."""
    def flow(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
        return str(value)

    return ", ".join(f"`{k}: {flow(v)}`" for k, v in settings.items())


def _cell(expected: str, family: Family) -> str:
    if expected != "exact":
        return f"*{expected}*"
    return f"**exact** with {_settings_text(family.settings)}" if family.settings else "**exact**"


if __name__ == "__main__":
    print(render(), end="")

"""Attention and size fields of a few popular models, for `validate` without the hub.

Only the fields the plan needs, copied from each model's published `config.json`. Used when
`base_model` is one of these ids and its config is neither cached locally nor reachable
(an offline laptop, a gated repo without a token); the plan then says so.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

_LLAMA31_8B = {**_LLAMA3_8B, "max_position_embeddings": 131072}

_LLAMA31_70B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}

_QWEN25_7B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}

_QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}

_MISTRAL_7B: dict[str, Any] = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}

_LLAMA32_1B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}

_QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}

# Keys are lower-case hub ids; instruct variants share the base model's shape.
_GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4"},
}

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "meta-llama/meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama/meta-llama-3-8b-instruct": _LLAMA3_8B,
    "meta-llama/llama-3-8b": _LLAMA3_8B,
    "meta-llama/llama-3-8b-instruct": _LLAMA3_8B,
    "nousresearch/meta-llama-3-8b": _LLAMA3_8B,
    "nousresearch/meta-llama-3-8b-instruct": _LLAMA3_8B,
    "meta-llama/llama-3.1-8b": _LLAMA31_8B,
    "nousresearch/meta-llama-3.1-8b": _LLAMA31_8B,
    "meta-llama/llama-3.2-1b": _LLAMA32_1B,
    "nousresearch/llama-3.2-1b": _LLAMA32_1B,
    "qwen/qwen3-8b": _QWEN3_8B,
    "meta-llama/llama-3.1-8b-instruct": _LLAMA31_8B,
    "meta-llama/meta-llama-3.1-8b": _LLAMA31_8B,
    "meta-llama/meta-llama-3.1-8b-instruct": _LLAMA31_8B,
    "meta-llama/llama-3.1-70b": _LLAMA31_70B,
    "meta-llama/llama-3.1-70b-instruct": _LLAMA31_70B,
    "meta-llama/meta-llama-3.1-70b": _LLAMA31_70B,
    "meta-llama/meta-llama-3.1-70b-instruct": _LLAMA31_70B,
    "qwen/qwen2.5-7b": _QWEN25_7B,
    "qwen/qwen2.5-7b-instruct": {**_QWEN25_7B, "max_position_embeddings": 32768},
    "qwen/qwen2.5-0.5b": _QWEN25_05B,
    "qwen/qwen2.5-0.5b-instruct": _QWEN25_05B,
    "mistralai/mistral-7b-v0.1": _MISTRAL_7B,
    "openai/gpt-oss-20b": _GPT_OSS_20B,
}


def lookup(model_id: str) -> dict[str, Any] | None:
    """The built-in config fields for a hub id (case-insensitive), or None if unknown."""
    entry = KNOWN_MODELS.get(model_id.strip().strip("/").lower())
    return dict(entry) if entry is not None else None

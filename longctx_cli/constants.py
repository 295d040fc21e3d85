"""Values every layer shares; a leaf module (imports nothing), so `parallel` may use it too."""

# The label of a token that carries no loss: torch's cross_entropy default ignore_index,
# and what Hugging Face datasets and collators write.
IGNORE_INDEX = -100

# Model types whose layers that mix tokens outside attention longctx runs exactly
# (`parallel/token_mixing.py`'s COVERED classes; tests/test_token_mixing.py checks the two
# agree). `validate` builds such a model on the meta device to describe those layers; for
# other model types its plan needs neither torch nor transformers.
HYBRID_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lara_mini", "lfm2",
    "lfm2_moe", "lfm3", "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "zamba2",
})

# The fused lm_head + cross-entropy (`train/loss.py`) builds logits this many bytes (float32)
# at a time: small beside a step's memory at any vocabulary, large enough that the block's
# matmuls run at speed. `validate`'s memory estimate counts the same block.
FUSED_LOSS_BLOCK_BYTES = 64 * 2**20
# Model-config keys of a logit transform after lm_head (`runtime/head.py`): such a head takes
# the autograd loss path, not the fused one.
LOGIT_TRANSFORM_KEYS = ("logit_scale", "logits_scaling", "final_logit_softcapping")
# The lean RMSNorm's backward (`runtime/memory_savers.py`) works on rows in chunks whose
# float32 temporaries total this many bytes: small beside a long row's [tokens, hidden]
# gradient, and few chunks (each a handful of kernel launches, which a GPU backward of this
# size partly waits on) per row. A chunk holds at most
# LEAN_NORM_CHUNK_TENSORS float32 [rows, hidden] tensors at once (the input's float32 copy,
# the incoming gradient times the weight, one product), which sets its rows.
LEAN_NORM_CHUNK_BYTES = 64 * 2**20
LEAN_NORM_CHUNK_TENSORS = 3
# ... and at least this many chunks: on a narrow model one byte budget can cover every row a
# rank holds, which would make its temporaries full-size again (a quarter is what remains).
LEAN_NORM_MIN_CHUNKS = 4
# Model types whose decoder layers' own norms (the layer's direct children) are all
# Llama-style RMSNorms, which training runs through the lean RMSNorm (`runtime/memory_savers.py`
# `is_llama_rms_norm`, checked against transformers 5.24's code): the memory estimate then
# counts no float32 copy of a norm's input. Only the families of tests/family_matrix.py,
# where tests/test_lean_norm.py checks this list against the built models; any other model
# type is estimated as if its norms kept their float32 copies (conservative).
LEAN_NORM_MODEL_TYPES = frozenset({
    "apertus", "arcee", "bamba", "deepseek_v2", "deepseek_v3", "exaone4", "falcon_h1", "glm4",
    "glm4_moe", "glm4_moe_lite", "granite", "granitemoehybrid", "hunyuan_v1_dense", "jamba",
    "kimi_linear", "lfm2", "lfm2_moe", "llama", "mimo_v2_flash", "minimax_m2", "ministral",
    "ministral3", "mistral", "mistral4", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe",
    "seed_oss", "smollm3", "zamba2",
})

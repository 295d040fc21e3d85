"""Values every layer shares; a leaf module (imports nothing), so `parallel` may use it too."""

# The label of a token that carries no loss: torch's cross_entropy default ignore_index,
# and what Hugging Face datasets and collators write.
IGNORE_INDEX = -100

# The fused lm_head + cross-entropy (`runtime/loss.py`) builds logits this many bytes (float32)
# at a time: small beside a step's memory at any vocabulary, large enough that the block's
# matmuls run at speed. `validate`'s memory estimate counts the same block.
FUSED_LOSS_BLOCK_BYTES = 64 * 2**20
# Gradients are summed over the replica group in buckets of at most this many bytes (one
# bucket's copy alive at a time, not a second copy of every gradient); a gradient at least
# this large is summed in place. DDP's default bucket size.
GRAD_BUCKET_BYTES = 25 * 2**20
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

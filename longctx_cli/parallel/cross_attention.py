"""Cross attention from this rank's text tokens to a row's image states (Mllama).

Mllama's text model has cross-attention layers whose keys and values are projections of
the vision tower's states (`cross_attention_states`), not of the text. Under sequence
parallelism each rank holds its own text tokens and the whole row's image states, so a
layer is local: this rank's queries against every key, with the mask rows of its own tokens
(runtime/vision.py builds both from the row). No key is exchanged between ranks and no
causal mask applies, so this never goes through the SP strategies of parallel/attention.py.

The model's own forward of one document skips these layers when the document has no
images: `SPMeta.cross_rows` is 0 on such tokens and their output is zero, so the layer's
gated residual leaves them as they were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .sharding import SPMeta


def is_cross_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is one of its config's `cross_attention_layers` (Mllama's)."""
    config = getattr(module, "config", None)
    layers = getattr(config, "cross_attention_layers", None) or ()
    return getattr(module, "layer_idx", None) in layers


def cross_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, meta: Any) -> torch.Tensor:
    """`[1, heads, local, dim]` queries against `[1, kv_heads, keys, dim]` image keys, with
    `mask` `[1, 1, local, keys]` (bool, True: attend); returns `[1, local, heads, dim]`."""
    if not isinstance(meta, SPMeta) or meta.cross_rows is None:
        raise ValueError(
            "a cross-attention layer ran without the row's image context; longctx computes "
            "Mllama's cross attention only through its rebuilt forward (runtime/vision.py).")
    if mask is None or mask.dtype != torch.bool or mask.shape[-2:] != (query.shape[2],
                                                                        key.shape[2]):
        raise ValueError("cross attention needs a boolean [1, 1, local tokens, image keys] mask")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: each key head serves `groups` query heads, as repeat_kv does
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    out = out * meta.cross_rows.to(out.dtype)[None, None, :, None]
    return out.transpose(1, 2).contiguous()

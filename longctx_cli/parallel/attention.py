"""One entry point for SP attention, and its registration with transformers.

``sp_attention`` dispatches on the SP mode and kernel. ``register_sp_attention`` makes it
available to every Hugging Face model that routes attention through ``AttentionInterface``
(load the model with ``attn_implementation="longctx_sp"`` and call it with ``sp_meta=``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .ring import ring_attention
from .sharding import SPMeta

ATTN_IMPLEMENTATION = "longctx_sp"


def _strategy(mode: str) -> Any:
    """The attention function of the ulysses / hybrid strategy module."""
    name = {"ulysses": "ulysses_attention", "hybrid": "hybrid_attention"}[mode]
    module_name = f"{__package__}.{mode}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        msg = f"sequence_parallel_mode {mode!r} is not implemented yet"
        raise NotImplementedError(msg) from err
    return getattr(module, name)


def sp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SPMeta, scale: float
) -> torch.Tensor:
    """Document-causal attention of this rank's tokens.

    q/k/v/out are ``[local_tokens, heads, dim]``.

    Query heads must be a multiple of key/value heads (GQA). Gradients are exact.
    """
    ctx = meta.ctx
    if q.shape[0] != meta.local_len:
        raise ValueError(f"got {q.shape[0]} local tokens, the SP metadata expects {meta.local_len}")
    if ctx.mode == "ring":
        if ctx.kernel == "flash":
            from .ring_flash import flash_ring_attention

            return flash_ring_attention(q, k, v, meta, scale)
        return ring_attention(q, k, v, meta, scale)
    if ctx.mode in ("ulysses", "hybrid"):
        return _strategy(ctx.mode)(q, k, v, meta, scale)
    raise ValueError(f"unknown sequence_parallel_mode {ctx.mode!r}")


def longctx_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature.

    q/k/v ``[1, heads, S, dim]`` -> ``([1, S, heads, dim], None)``.
    """
    meta = kwargs.get("sp_meta")
    if not isinstance(meta, SPMeta):
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the batch's SP metadata: call the "
            "model as model(input_ids=..., position_ids=..., sp_meta=batch.sp_meta)"
        )
    if query.shape[0] != 1:
        raise ValueError("SP attention takes one packed row per call (batch size 1)")
    if dropout:
        raise ValueError("attention dropout is not supported with SP attention; set it to 0")
    if attention_mask is not None:
        raise ValueError("SP attention builds document masks itself; attention_mask must be None")
    scale = scaling if scaling is not None else module.scaling
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = sp_attention(q, k, v, meta, scale)
    meta.attention_calls += 1
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for our implementation: documents are handled inside the kernel."""
    return None


def register_sp_attention() -> str:
    """Register ``longctx_sp`` with transformers; returns the implementation name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, longctx_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION

"""The ``flash`` kernel: ring-flash-attn's llama3 varlen attention (GPU, contiguous layout)
and its P2P ring functions (``ring`` / ``zigzag_ring`` / ``stripe_flash_attn_func``).

``ring_flash_attn`` imports ``flash_attn`` at import time, so it is loaded lazily, only when
this kernel runs. Its package ``__init__`` also imports an adapter for transformers 4
internals that transformers 5 removed; when that is the only failure we load just the
modules we use.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from longctx_cli.kernel_choice import import_ring_flash_module

from .features import AttentionFeatures, as_features
from .sharding import SPMeta
from .torch_flash import pad_head_dim

_MODULE = "ring_flash_attn.llama3_flash_attn_varlen"
# ring_attn_func -> (module, function) of ring-flash-attn's P2P rings (batched, one sequence)
_P2P = {
    "batch_ring": ("ring_flash_attn.ring_flash_attn", "ring_flash_attn_func"),
    "batch_zigzag": ("ring_flash_attn.zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func"),
    "batch_stripe": ("ring_flash_attn.stripe_flash_attn", "stripe_flash_attn_func"),
}


def _import_module(name: str = _MODULE) -> types.ModuleType:
    try:
        return import_ring_flash_module(name)
    except ImportError as err:
        raise ImportError(
            "attention_kernel: flash needs flash-attn 2 and ring-flash-attn (docs/gpu.md); "
            f"use attention_kernel: torch_flash or torch otherwise ({err})"
        ) from err


def flash_window(feats: AttentionFeatures) -> tuple[int, int]:
    """flash-attn's ``window_size``: with ``causal`` it sees keys ``p - left .. p``."""
    return (-1, -1) if feats.window is None else (feats.window - 1, feats.window - 1)


def equal_head_dims(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v padded to one head dim, and v's own (cut the output back to it).

    flash-attn 2 takes one head dim for q, k and v; multi-head latent attention (DeepSeek)
    has a value head dim unlike the q/k one. Zero padding is exact (see
    :func:`.torch_flash.pad_head_dim`) and autograd drops the padded columns' gradients; it
    costs the padded columns' memory and, in a ring, their communication.
    """
    d = max(q.shape[-1], v.shape[-1])
    return pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d), v.shape[-1]


def refuse_flash_sinks(sinks: torch.Tensor | None) -> None:
    if sinks is not None:
        raise NotImplementedError(
            "attention sinks (s_aux) are not supported by attention_kernel: flash: flash-attn 2's "
            "varlen kernel has no sink argument, so the model would silently train without "
            "them. Use attention_kernel: torch, which adds the sinks exactly through the "
            "log-sum-exp merge."
        )


def load_ring_flash_attn() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(llama3_flash_attn_varlen_func, llama3_flash_attn_prepare_cu_seqlens)``."""
    mod = _import_module()
    return mod.llama3_flash_attn_varlen_func, mod.llama3_flash_attn_prepare_cu_seqlens


def _flash_params(
    meta: SPMeta, prepare: Callable[..., Any], device: torch.device
) -> tuple[Any, ...]:
    """This rank's cu_seqlens_q/k, max lengths and key slice; computed once per row."""
    return meta.derived(_new_flash_params, prepare, device)


def _new_flash_params(
    meta: SPMeta, prepare: Callable[..., Any], device: torch.device
) -> tuple[Any, ...]:
    cu = meta.cu_seqlens.to(device=device, dtype=torch.int32)  # the kernels read it there
    return prepare(cu, True, meta.ctx.sp_rank, meta.ctx.layout.sp)


def flash_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document-causal SP attention through ring-flash-attn (``[local_tokens, heads, dim]``).

    Sliding windows are passed to the kernel (``window_size``); softcapping only at sp=1
    (ring-flash-attn 0.1.8's llama3 path has no softcap argument); sinks never.
    """
    if meta.prefixes:  # two key ranges per branch: our ring, on this kernel's flash op blocks
        from .ring import ring_attention

        return ring_attention(q, k, v, meta, features, sinks)
    ctx = meta.ctx
    feats = as_features(features)
    refuse_flash_sinks(sinks)
    q, k, v, v_dim = equal_head_dims(q, k, v)
    if ctx.layout.sp == 1:
        return flash_single(q, k, v, meta, feats)[..., :v_dim]
    if feats.softcap is not None:
        raise NotImplementedError(
            f"attention logit softcapping (softcap={feats.softcap}) is not supported by "
            "attention_kernel: flash with sequence_parallel_mode: ring at sp > 1: "
            "ring-flash-attn 0.1.8's llama3 function passes no softcap to flash-attn, so the "
            "model would silently train uncapped. Use sequence_parallel_mode: ulysses (flash-attn "
            "applies the cap itself) or attention_kernel: torch."
        )
    func, prepare = load_ring_flash_attn()
    cu_q, cu_k, max_q, max_k, k_slice = _flash_params(meta, prepare, q.device)
    # Bottom-right causal alignment makes flash's window relative to each query's own key
    # position, and cu_seqlens_k starts every document's keys at its start: the window is
    # clipped at the document start, as the model's mask clips it.
    out = func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        ctx.layout.heads_k_stride,
        k_slice,
        dropout_p=0.0,
        softmax_scale=feats.scale,
        causal=True,
        window_size=flash_window(feats),
        group=ctx.sp_group,
    )
    return out[..., :v_dim]


def flash_single(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SPMeta, feats: AttentionFeatures
) -> torch.Tensor:
    """sp == 1: no ring, plain flash-attn varlen over the row's documents, with the layer's
    attention dropout in training (``feats.dropout``, as ``flash_attention_2`` passes it)."""
    from flash_attn import flash_attn_varlen_func

    # Once per row, not per layer (`int` syncs the GPU).
    cu, max_len = meta.derived(_row_cu_seqlens, q.device)
    return flash_attn_varlen_func(
        q, k, v, cu, cu, max_len, max_len, dropout_p=feats.dropout, softmax_scale=feats.scale,
        causal=True, window_size=flash_window(feats), softcap=feats.softcap or 0.0,
    )


def flash_p2p_unfit(
    q: torch.Tensor, meta: SPMeta, feats: AttentionFeatures, sinks: torch.Tensor | None
) -> str | None:
    """Why ring-flash-attn's P2P functions would not compute this row exactly, or None.

    They attend over the whole row as one sequence (no cu_seqlens: a packed or padded row
    would attend across documents) and pass neither softcap nor sinks; a window is applied
    per block with the block's own alignment, which is wrong off the diagonal. flash-attn
    computes in fp16/bf16 only (and 0.1.8's float32 accumulators alias its block buffers
    when the inputs are float32 already).
    """
    docs = len(meta.cu_seqlens) - 1
    if docs > 1:
        return (
            f"the row holds {docs} documents (packed or padded); ring-flash-attn's P2P "
            "functions take one sequence and would attend across documents"
        )
    if feats.window is not None:
        return "sliding window: ring-flash-attn's P2P functions apply it per block"
    if feats.softcap is not None:
        return "logit softcapping: ring-flash-attn 0.1.8's P2P functions have no softcap"
    if sinks is not None:
        return "attention sinks: flash-attn 2 has no sink argument"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}: flash-attn computes in float16/bfloat16 only"
    if meta.ctx.layout.ring_attn_func == "batch_ring" and q.dtype == torch.float16:
        return "float16: ring-flash-attn 0.1.8's batch_ring returns dq in bfloat16"
    return None


def flash_p2p_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
) -> torch.Tensor:
    """One-sequence causal attention through ring-flash-attn's P2P ring of ``ring_attn_func``.

    ``[local_tokens, heads, dim]``; the layout must be the function's own (ring: contiguous,
    zigzag: chunks ``r`` and ``2N-1-r``, stripe: token ``i`` on rank ``i % N``), which
    the :class:`~longctx_cli.layout.Layout` guarantees.
    """
    ctx = meta.ctx
    feats = as_features(features)
    module, name = _P2P[ctx.layout.ring_attn_func]
    func = getattr(_import_module(module), name)
    q, k, v, v_dim = equal_head_dims(q, k, v)
    out = func(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dropout_p=0.0,
        softmax_scale=feats.scale, causal=True, group=ctx.sp_group,
    )
    return out[0, ..., :v_dim]


def _row_cu_seqlens(meta: SPMeta, device: torch.device) -> tuple[torch.Tensor, int]:
    """The row's document boundaries on `device` and the longest document."""
    cu = meta.cu_seqlens.to(device=device, dtype=torch.int32)
    return cu, meta.max_seqlen

"""One entry point for SP attention, and its registration with transformers.

``sp_attention`` runs the strategy that ``STRATEGIES`` maps (mode, variant) to.
``register_sp_attention`` makes it available to every Hugging Face model that routes
attention through ``AttentionInterface`` (load the model with
``attn_implementation="longctx_sp"`` and call it with ``sp_meta=``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch

from .cross_attention import cross_attention, is_cross_attention
from .decode import DecodeMeta, decode_attention
from .features import AttentionFeatures, as_features
from .mesh import ParallelState
from .ring import ring_attention
from .sharding import SPMeta, causal_meta, chunked_meta

ATTN_IMPLEMENTATION = "longctx_sp"


class AttentionStrategy(Protocol):
    """What every SP strategy implements: this rank's document-causal attention output."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: SPMeta,
        features: AttentionFeatures,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor: ...


def ring_strategy(ctx: ParallelState) -> AttentionStrategy:
    """The ring a layout runs (alone, or across the Ulysses groups of hybrid): a P2P ring
    (``batch_*``), else the llama3 ring; each ring-flash-attn's own under the ``flash``
    kernel (``ctx.kernel.flash_attn``), else ours on the state's resolved kernel."""
    if ctx.layout.p2p:
        from .ring_p2p import (  # lazy: only P2P runs need it
            flash_p2p_ring_attention,
            p2p_ring_attention,
        )

        return flash_p2p_ring_attention if ctx.kernel.flash_attn else p2p_ring_attention
    if ctx.kernel.flash_attn:
        from .ring_flash import flash_ring_attention  # lazy: needs ring_flash_attn

        return flash_ring_attention
    return ring_attention


def strategy_for(ctx: ParallelState) -> AttentionStrategy:
    """The strategy function a rank with this state runs, on the kernel the state resolved."""
    if ctx.layout.mode == "ring":
        return ring_strategy(ctx)
    if ctx.layout.mode == "ulysses":
        from .ulysses import flash_ulysses_attention, ulysses_attention

        return flash_ulysses_attention if ctx.kernel.flash_attn else ulysses_attention
    if ctx.layout.mode == "hybrid":
        from .ulysses_ring import hybrid_attention

        return partial(hybrid_attention, ring=ring_strategy(ctx))
    raise ValueError(f"unknown sequence_parallel_mode {ctx.layout.mode!r}")


def sp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document-causal attention of this rank's tokens.

    q/k/v/out are ``[local_tokens, heads, dim]``. ``features`` is the layer's
    :class:`AttentionFeatures` (a bare number means a plain scale); ``sinks`` ``[heads]``
    (optional, differentiable) adds one value-less logit per head to every softmax.

    Query heads must be a multiple of key/value heads (GQA). Gradients are exact.
    """
    ctx = meta.ctx
    feats = as_features(features)
    if q.shape[0] != meta.local_len:
        raise ValueError(f"got {q.shape[0]} local tokens, the SP metadata expects {meta.local_len}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"attention sinks must be one per query head ({q.shape[1]}), got {tuple(sinks.shape)}"
        )
    if meta.bidirectional and meta.bidirectional_sliding_only and feats.window is None:
        meta = causal_meta(meta)  # Gemma 4's full-attention layers: its images causal
    if feats.dropout:  # training with attention dropout: whole rows only (see .dropout)
        from .dropout import dropout_attention

        strategy: AttentionStrategy = dropout_attention
    elif meta.bidirectional:  # image runs: only Ulysses holds whole rows (one rank does too)
        if ctx.layout.sp > 1 and ctx.layout.mode != "ulysses":
            raise NotImplementedError(
                "image tokens that attend to each other both ways need sequence_parallel_mode "
                f"ulysses; {ctx.layout.mode} splits each document's keys across ranks")
        from .ulysses import ulysses_attention

        strategy = ulysses_attention
    else:
        strategy = strategy_for(ctx)
    if feats.chunk is not None:  # chunked local attention: chunk starts are segment starts
        meta, feats = chunked_meta(meta, feats.chunk), replace(feats, chunk=None)
    # Autocast off: every strategy keeps its statistics and merges in float32 itself, and
    # q/k/v already carry the compute dtype (see `longctx_attention_forward`).
    with torch.autocast(q.device.type, enabled=False):
        return strategy(q, k, v, meta, feats, sinks)


# kwargs transformers' attention layers pass that do not change what attention computes
# (positions are already in q/k through RoPE; there is no KV cache in training).
_NEUTRAL_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "cache",  # transformers >= 5.2x names the KV cache `cache`
        "past_key_values",
        "past_key_value",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "sp_meta",
    }
)


def attention_features(module: torch.nn.Module, scaling: float | None, kwargs: dict) -> tuple[
    AttentionFeatures, torch.Tensor | None
]:
    """The layer's features from the kwargs transformers passes; refuses any it cannot honour."""
    unknown = sorted(
        k for k in kwargs if k not in _NEUTRAL_KWARGS | {"sliding_window", "softcap", "s_aux"}
    )
    if kwargs.get("is_causal", True) is not True:
        raise ValueError("SP attention is causal; the layer asked for is_causal=False")
    unknown = [k for k in unknown if k != "is_causal"]
    if unknown:
        raise ValueError(
            f"{type(module).__name__} passes attention arguments longctx does not implement: "
            f"{', '.join(unknown)}. They may change what attention computes, so training would "
            "not be exact; refusing instead of ignoring them."
        )
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    if scale is None:
        raise ValueError(f"{type(module).__name__} passes no attention scaling")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise ValueError(f"s_aux (attention sinks) must be a tensor, got {type(sinks).__name__}")
    feats = AttentionFeatures(
        scale=float(scale),
        window=None if window is None else int(window),
        softcap=None if softcap is None else float(softcap),
        chunk=layer_chunk(module),
    )
    return feats, sinks


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-local-attention layer (Llama 4), None for other layers.

    transformers passes the attention function nothing for it: the model builds a chunked
    mask (``create_chunked_causal_mask``, of ``config.attention_chunk_size``) for the layers
    whose ``config.layer_types[layer_idx]`` is ``"chunked_attention"``, and longctx builds no
    mask. So the layer's type is read from the same config fields; a config with a chunk size
    whose layer types cannot be read is refused rather than trained as plain causal.
    """
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        return None
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not isinstance(types, (list, tuple)) or not isinstance(index, int) or not (
            0 <= index < len(types)):
        raise ValueError(
            f"{type(module).__name__}: the model config sets attention_chunk_size="
            f"{chunk} but longctx cannot tell which layers use chunked attention (no "
            "layer_types / layer_idx); refusing instead of training them as plain causal."
        )
    return int(chunk) if types[index] == "chunked_attention" else None


def temperature_scale(index: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """Llama 4's NoPE-layer query scale of each token index, as the module computes it
    (float32): ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1``."""
    return torch.log1p(torch.floor((index.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def true_index(meta: SPMeta) -> torch.Tensor:
    """``[local_tokens]`` each local token's index in its input row of the model's own
    training (``meta.row_starts``), from its global index (zigzag included)."""
    index = torch.cat([torch.arange(a, b) for a, b in meta.local_ranges])
    starts = torch.tensor(meta.row_starts)
    return index - starts[torch.searchsorted(starts, index, right=True) - 1]


def _rescale(meta: SPMeta, floor: int, attn_scale: float, local_len: int,
             device: torch.device) -> torch.Tensor | None:
    """``[local_tokens]`` true scale / the module's scale (of ``arange(local_len)``), float32;
    None where they are equal everywhere. Built once per row."""
    local = torch.arange(local_len)
    ratio = temperature_scale(true_index(meta), floor, attn_scale) / temperature_scale(
        local, floor, attn_scale)
    return None if bool((ratio == 1).all()) else ratio.to(device)


def true_temperature(module: torch.nn.Module, query: torch.Tensor, meta: SPMeta
                     ) -> torch.Tensor:
    """``query`` ``[1, heads, S, dim]`` with the scale of each token's true index.

    Llama 4's NoPE layers (``attn_temperature_tuning``) scale queries by
    :func:`temperature_scale` of ``i = arange(input length)``: under SP that is the index in
    this rank's slice. The true index is the token's index in its row of the model's own
    training (``SPMeta.row_starts``); the module's scale is divided out and the true one
    applied, in float32 (equal to the model's own forward within 2 float32 roundings; in
    bf16 the module's cast adds one bf16 rounding). Where the rows are unknown, refuses once
    an index or document reaches ``floor_scale - 1`` (below that every scale is 1).
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor = getattr(module, "floor_scale", None)
    if not floor:
        return query
    if meta.row_starts is None and meta.ctx.layout.sp == 1 and len(meta.cu_host) == 2:
        return query  # one document from index 0: the module's index is the token's
    if meta.row_starts is None:
        if max(meta.local_len, meta.max_seqlen) >= floor:
            raise ValueError(
                f"{type(module).__name__} scales NoPE-layer queries by the token's index in "
                f"the forward's input (attn_temperature_tuning, floor_scale={floor}); with "
                f"{meta.local_len} tokens per rank and documents of up to {meta.max_seqlen} "
                "tokens, and rows of the model's own training longctx does not know here "
                "(preference pairs, KTO, GRPO, reward models), that index is not the "
                "token's, so the model would train differently. Keep rows per rank and "
                "documents shorter than floor_scale, or set attn_temperature_tuning to false."
            )
        return query
    ratio = meta.derived(_rescale, int(floor), float(module.attn_scale), query.shape[2],
                         query.device)
    if ratio is None:
        return query
    return (query.float() * ratio[:, None]).to(query.dtype)


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

    q/k/v ``[1, heads, S, dim]`` -> ``([1, S, heads, dim], None)``. Honours the layer's
    ``scaling``, ``dropout`` (:mod:`.dropout`), ``sliding_window``, ``softcap`` and ``s_aux``
    (sinks); refuses other arguments that would change the math.
    """
    meta = kwargs.get("sp_meta")
    if is_cross_attention(module):  # Mllama's: text queries, image keys, local to the rank
        if isinstance(meta, DecodeMeta):
            raise ValueError("decoding after images is not supported for cross-attention "
                             "layers (Mllama): their cached image keys are not kept")
        scale = scaling if scaling is not None else module.scaling
        return cross_attention(query, key, value, attention_mask, float(scale), meta), None
    if isinstance(meta, DecodeMeta):  # one new token after an SP prefill (KV cache kept)
        feats, sinks = attention_features(module, scaling, kwargs)
        out = decode_attention(query[:, :, -1], key.transpose(1, 2), value.transpose(1, 2),
                               meta, feats, sinks, getattr(module, "layer_idx", None))
        meta.attention_calls += 1
        return out[:, None], None
    if not isinstance(meta, SPMeta):
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the batch's SP metadata: call the "
            "model as model(input_ids=..., position_ids=..., sp_meta=batch.sp_meta)"
        )
    if query.shape[0] != 1:
        raise ValueError("SP attention takes one packed row per call (batch size 1)")
    if isinstance(attention_mask, RefusedMask):
        raise ValueError(attention_mask.reason)  # a layer does attend with that mask
    if attention_mask is not None:
        raise ValueError("SP attention builds document masks itself; attention_mask must be None")
    feats, sinks = attention_features(module, scaling, kwargs)
    query = true_temperature(module, query, meta)  # Llama 4's NoPE layers
    if dropout:  # the layer's attention dropout (transformers passes 0 in eval)
        feats = replace(feats, dropout=float(dropout))
    if torch.is_grad_enabled() and attention_inputs_spent(type(module)) and _apart(
            query, key, value):
        feats = replace(feats, spent=True)  # training: no KV cache keeps them either
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # fp16 training (fp32 master weights): RoPE's float32 cos/sin promote q and k while
        # v stays half. Attention computes in the autocast dtype, as SDPA does under autocast.
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    out = sp_attention(q, k, v, meta, feats, sinks)
    meta.attention_calls += 1
    return out.unsqueeze(0), None


@functools.cache
def attention_inputs_spent(layer: type) -> bool:
    """Whether ``layer.forward`` reads the q, k and v it hands the attention function no more
    once that call returns, shown on its source: one ``attention_interface(self, q, k, v, ...)``
    call of three plain names, outside any loop, and no read of those names after it. False
    whenever that cannot be shown (no source, another shape of code)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(layer.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    forward = tree.body[0]
    calls = [node for node in ast.walk(forward) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "attention_interface"]
    if len(calls) != 1:
        return False
    call = calls[0]
    inputs = call.args[1:4]
    if len(inputs) != 3 or not all(isinstance(a, ast.Name) for a in inputs):
        return False
    names = {a.id for a in inputs}
    loops = (ast.For, ast.AsyncFor, ast.While)
    if any(isinstance(node, loops) and call in list(ast.walk(node)) for node in ast.walk(forward)):
        return False  # a later pass could read them before the call
    end = (call.end_lineno, call.end_col_offset)
    if any(_keeps(node, names) for node in ast.walk(forward)):
        return False  # stored for later layers (Gemma 3n/4's shared keys and values)
    return not any(isinstance(node, ast.Name) and node.id in names
                   and (node.lineno, node.col_offset) > end for node in ast.walk(forward))


def _apart(*tensors: torch.Tensor) -> bool:
    """No two of `tensors` share memory (Gemma 4's full layers hand the keys as values)."""
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    return len(set(pointers)) == len(pointers)


def _keeps(node: ast.AST, names: set[str]) -> bool:
    """An assignment that stores one of `names` somewhere other than a plain local name (a
    subscript or an attribute: a dict of shared keys and values, the module itself)."""
    if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List))
                                         else [t])]
    if all(isinstance(t, ast.Name) for t in flat) or node.value is None:
        return False
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.value))


def _mask_pattern(mask_function: Any, q_offset: int, kv_offset: int, n: int) -> torch.Tensor:
    """``[n, n]`` bool: what the model's mask function allows on its first ``n`` positions."""
    zero = torch.zeros(1, dtype=torch.long)
    qi = torch.arange(n)[None, None, :, None] + q_offset
    ki = torch.arange(n)[None, None, None, :] + kv_offset
    try:
        allowed = mask_function(zero[:, None, None, None], zero[None, :, None, None], qi, ki)
        return torch.as_tensor(allowed, dtype=torch.bool).expand(1, 1, n, n)[0, 0]
    except Exception:  # some overlays only run under vmap, as transformers runs them
        from transformers.masking_utils import TransformGetItemToIndex, _vmap_expansion_sdpa

        with TransformGetItemToIndex():
            allowed = _vmap_expansion_sdpa(mask_function)(
                torch.arange(1), torch.arange(1), torch.arange(n) + q_offset,
                torch.arange(n) + kv_offset,
            )
        return allowed[0, 0].bool()


def _no_mask(
    *args: Any,
    mask_function: Any = None,
    q_length: int = 0,
    kv_length: int = 0,
    q_offset: int = 0,
    kv_offset: int = 0,
    **kwargs: Any,
) -> None:
    """Mask builder for our implementation: documents and windows are handled in the kernel.

    The model's mask is not built, but it is checked on its first positions: every query
    must see a run of keys ending at itself (causal, possibly windowed or cut at a document
    start, both of which we reproduce). A mask that lets a query see later keys (bidirectional
    or blockwise overlays) is refused rather than silently replaced by a causal one.
    """
    n = min(q_length, kv_length, 64)
    if mask_function is None or n == 0 or q_offset > 0:
        # q_offset > 0: a decode step after a cached prefill, whose mask was checked here;
        # the decode attention counts every earlier token itself (parallel/decode.py).
        return None
    allowed = _mask_pattern(mask_function, q_offset, kv_offset, n)
    idx = torch.arange(n)
    causal = idx[None, :] <= idx[:, None]
    # A run ending at the diagonal: allowed keys are contiguous and include the query itself.
    first = torch.where(allowed.any(-1), allowed.float().argmax(-1), idx)
    run = (idx[None, :] >= first[:, None]) & causal
    if q_offset != kv_offset or not torch.equal(allowed, run):
        # Refused where a layer attends with it: a model may build a mask for a layer type
        # none of its layers has (Qwen2-MoE's sliding mask of window 0 beside full layers).
        return RefusedMask(
            "the model's attention mask is not causal (a query may see later keys, or keys "
            "with gaps, e.g. a bidirectional or blockwise overlay); longctx's SP attention "
            "computes document-causal (optionally sliding-window) attention only, so this "
            "model would train on a different mask. Refusing."
        )
    return None


class RefusedMask:
    """What the mask builder returns for a mask longctx cannot compute: any use of it (a
    layer attending with it, or reading it) raises the refusal."""

    def __init__(self, reason: str):
        self.__dict__["reason"] = reason

    def __getattr__(self, name: str) -> Any:
        raise ValueError(self.__dict__["reason"])

    def __getitem__(self, index: Any) -> Any:
        raise ValueError(self.__dict__["reason"])

    def _refuse(self, *args: Any) -> Any:
        raise ValueError(self.__dict__["reason"])

    # A layer that adds the mask to its scores itself (RoFormer): the same refusal.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __bool__ = _refuse


def register_sp_attention() -> str:
    """Register ``longctx_sp`` with transformers; returns the implementation name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, longctx_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION

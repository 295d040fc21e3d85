"""Hybrid (USP) sequence parallelism: Ulysses inside groups of ``U`` ranks, a ring across them.

The SP group of size ``N`` is ``R = N / U`` Ulysses groups of ``U`` consecutive ranks; rank
``u`` of every Ulysses group belongs to ring ``u`` (see :mod:`.mesh`). SP rank ``s`` is
member ``u = s % U`` of Ulysses group ``g = s // U``.

After the Ulysses all-to-all, rank ``(g, u)`` holds head slice ``u`` (``[u*H/U, (u+1)*H/U)``,
or member ``u``'s share of an uneven split, :func:`~longctx_cli.layout.head_split`) for every
token of Ulysses group ``g``, sorted by global position. That token set is exactly what
rank ``g`` of an ``R``-rank SP group with the *same layout* would own:

* contiguous: ranks ``gU .. gU+U-1`` own the consecutive block ``g`` of ``R``;
* zigzag (``2N`` chunks, rank ``s`` owns chunks ``s`` and ``2N-1-s``): the group owns chunks
  ``[gU, (g+1)U)`` and ``[2N-(g+1)U, 2N-gU)``, i.e. super-chunks ``g`` and ``2R-1-g`` of a
  ``2R``-chunk zigzag, first one first once sorted.

So the ring runs unchanged on a derived ``R``-rank context over ``ring_group``, on the
heads this rank holds; every ring member holds the same head slice ``u``. That ring is the
llama3 all-gather or, with ``ring_attn_func: batch_ring | batch_zigzag``, the P2P ring of
:mod:`.ring_p2p`. The stripe layout has no such correspondence and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from math import gcd

import torch

from longctx_cli.layout import head_split

from .features import AttentionFeatures, as_features
from .sharding import SPMeta, local_ranges, segments_for
from .ulysses import build_exchange, heads_to_ranks, heads_to_seq


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined, for comparing two descriptions of the same token set."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def ring_meta(meta: SPMeta, local_kv_heads: int) -> SPMeta:
    """Metadata of the ring across Ulysses groups, as if it were an ``R``-rank SP group.

    ``heads_k_stride`` is reduced to a divisor of the KV heads left on this rank.
    """
    return meta.derived(_new_ring_meta, local_kv_heads)


def _new_ring_meta(meta: SPMeta, local_kv_heads: int) -> SPMeta:
    ctx = meta.ctx
    u = ctx.layout.ulysses
    ring_ctx = replace(
        ctx,
        layout=ctx.layout.ring_part(gcd(ctx.layout.heads_k_stride, local_kv_heads)),
        sp_group=ctx.ring_group,
        sp_rank=ctx.sp_rank // u,
        ulysses_group=None,
        ring_group=None,
    )
    ranges = local_ranges(meta.total_len, ring_ctx)
    ex = build_exchange(meta, ctx.ulysses_group, u)
    held = [(s, s + ex.piece_len) for s in ex.starts]
    if _merged(held) != _merged(list(ranges)):  # the layout argument in the module docstring
        raise AssertionError(f"Ulysses group holds {held}, the ring expects {ranges}")
    return SPMeta(
        ctx=ring_ctx,
        cu_seqlens=meta.cu_seqlens,
        total_len=meta.total_len,
        local_ranges=ranges,
        segments=segments_for(meta.cu_host, ranges, meta.prefixes),
        cu_host=meta.cu_host,
        prefixes=meta.prefixes,
    )


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
    *,
    ring: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Exact document-causal attention of this rank's tokens, Ulysses x ring.

    q: ``[local_tokens, H, D]``, k/v: ``[local_tokens, H_kv, D]``; returns ``[local_tokens, H, D]``.
    Needs ``H >= U`` (the heads may split unevenly, by whole KV-head groups). ``sinks`` ``[H]``
    optional.
    """
    ctx = meta.ctx
    u = ctx.layout.ulysses
    # The Layout refused stripe sharding and a ulysses degree not dividing sp.
    ex = build_exchange(meta, ctx.ulysses_group, u)
    feats = as_features(features)
    qh, kh, vh = heads_to_ranks(q, k, v, ex, feats.spent)
    split = head_split(q.shape[1], k.shape[1], u)
    local_sinks = None if sinks is None else sinks[split.q_slice(ex.member)]
    # `ring`: the ring strategy the layout picked (``attention.ring_strategy``); every member
    # of this rank's ring holds the same heads (the same member of its Ulysses group).
    out = ring(qh, kh, vh, ring_meta(meta, kh.shape[1]), feats, local_sinks)
    return heads_to_seq(out, ex, split.q_counts)

"""Document-causal attention of query rows over their keys, on a resolved kernel.

This is the part of SP attention that has nothing to do with communication: given local
queries and a key/value tensor, attend each query to the keys it may see inside its own
document. Strategies (ring, Ulysses) reduce their work to calls of these functions: the
rows of a full row or a shard as segments (:func:`doc_causal_forward` / ``_backward``,
:func:`doc_causal_attention`), a P2P ring's key block as pieces (:func:`pieces_forward` /
``_backward``).

Which keys each row sees, cut into blocks, is :mod:`.block_geometry`'s (whole numbers);
the partial results are merged exactly through their log-sum-exp (:mod:`.lse_merge`, sinks
too), and the backward of each block is computed with the merged output and log-sum-exp,
which gives exact gradients.

Every function takes the ``kernel`` resolved once per rank (``ctx.kernel``, an
:class:`~.kernel.AttentionKernel`; a name is resolved on entry). Its fused ops (PyTorch's
flash op, cuDNN, flash-attn 4) take every call they compute exactly, all segments at once;
what they cannot take, and every call of the ``torch`` kernel, runs block by block on the
block paths (:mod:`.cpu_flash`: the CPU flash op, or :mod:`.tiled` on CUDA and for
softcapped layers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from longctx_cli.layout import Kernel

from .block_geometry import (
    Block,
    Piece,
    full_row_segments,
    piece_blocks,
    piece_flash_calls,
    sees_whole,
    segment_blocks,
    whole_block,
)
from .cpu_flash import bhld, block_backward, block_forward, lhd
from .features import AttentionFeatures, Segment, as_features
from .kernel import TORCH, AttentionKernel, FusedOps, as_kernel, fused_for
from .lse_merge import apply_sinks, float32_inside, merge_f32, out_like, sink_grad

__all__ = [
    "AttentionFeatures",
    "Segment",
    "as_features",
    "doc_causal_attention",
    "doc_causal_backward",
    "doc_causal_forward",
    "pieces_backward",
    "pieces_forward",
]


def _store(
    out: torch.Tensor,
    lse: torch.Tensor,
    r0: int,
    r1: int,
    o: torch.Tensor,
    lo: torch.Tensor,
    accumulate: bool,
) -> None:
    """Rows ``[r0, r1)`` of ``out`` / ``lse`` get ``o [1, H, rows, D]`` / ``lo [H, rows]``."""
    if not accumulate:
        out[r0:r1] = lhd(o)
        lse[:, r0:r1] = lo
        return
    m_o, m_l = merge_f32(out[r0:r1].transpose(0, 1), lse[:, r0:r1], o[0].float(), lo.float())
    out[r0:r1] = m_o.transpose(0, 1)
    lse[:, r0:r1] = m_l


def _forward_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Iterable[list[Block]],
    feats: AttentionFeatures,
    out: torch.Tensor,
    lse: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """Write the merged result of every block group into its rows of ``out`` / ``lse``.

    A group's first block covers all its rows; later ones a prefix of them (see
    :func:`.block_geometry.segment_blocks`). Rows no group covers are left untouched.
    ``accumulate``: merge with what the rows already hold (groups may then share rows; out is
    float32).
    """
    for blocks in groups:
        r0, r1 = blocks[0].q0, blocks[0].q1
        qs = bhld(q[r0:r1])
        if len(blocks) == 1:  # nothing to merge: keep the kernel's dtype, no fp32 copy
            blk = blocks[0]
            o, lo = block_forward(
                qs, bhld(k[blk.k0 : blk.k1]), bhld(v[blk.k0 : blk.k1]), blk, feats
            )
            _store(out, lse, r0, r1, o, lo[0], accumulate)
            continue
        acc, acc_lse = None, None
        for blk in blocks:
            o, lo = block_forward(
                qs[:, :, : blk.q1 - r0], bhld(k[blk.k0 : blk.k1]),
                bhld(v[blk.k0 : blk.k1]), blk, feats,
            )
            o, lo = o.float(), lo.float()
            if acc is None:
                acc, acc_lse = o, lo
            else:  # later blocks may cover a prefix of the rows (the edge)
                rows = slice(0, blk.q1 - r0)
                m_o, m_l = merge_f32(acc[:, :, rows], acc_lse[:, :, rows], o, lo)
                acc[:, :, rows], acc_lse[:, :, rows] = m_o, m_l
        _store(out, lse, r0, r1, acc, acc_lse[0], accumulate)


def _backward_groups(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    groups: Iterable[list[Block]],
    feats: AttentionFeatures,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Accumulate every block's gradients into ``dq`` / ``dk`` / ``dv`` (given merged out, lse)."""
    for blocks in groups:
        for blk in blocks:
            rows = slice(blk.q0, blk.q1)
            keys = slice(blk.k0, blk.k1)
            dq1, dk1, dv1 = block_backward(
                bhld(dout[rows]), bhld(q[rows]), bhld(k[keys]), bhld(v[keys]),
                bhld(out[rows]), lse[:, rows].unsqueeze(0).contiguous(), blk, feats,
            )
            dq[rows] += lhd(dq1)
            dk[keys] += lhd(dk1)
            dv[keys] += lhd(dv1)


def _whole_causal_block(keys: slice) -> Block:
    """The one causal square of :func:`.block_geometry.whole_block` as a block."""
    n = keys.stop - keys.start
    return Block(0, n, keys.start, keys.stop, keys.start, True)


def _merge_prefix_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
    feats: AttentionFeatures, out: torch.Tensor, lse: torch.Tensor, op: FusedOps,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's results over each segment's own keys, merged with every branch
    segment's prefix keys (one block with no mask per branch segment, also on the op)."""
    branches = [seg for seg in segments if seg.has_prefix]
    if not branches:
        return out, lse
    if feats.window is not None:
        raise ValueError("sliding-window attention with shared pair prompts (`prefix_sharing`) "
                         "is not supported")
    out, lse = out.clone(), lse.clone()  # never write into the op's own tensors
    for seg in branches:
        rows, keys = slice(seg.q_start, seg.q_end), slice(seg.p_start, seg.p_end)
        o, lo = op.block_forward(q[rows], k[keys], v[keys], False, feats)
        merged, lse[:, rows] = merge_f32(out[rows].transpose(0, 1).float(), lse[:, rows],
                                         o.transpose(0, 1).float(), lo)
        out[rows] = merged.transpose(0, 1).to(out.dtype)
    return out, lse


def _bidirectional_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
    feats: AttentionFeatures, out: torch.Tensor, lse: torch.Tensor, op: FusedOps,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of every bidirectional segment (an image's tokens), which the op's causal
    varlen call left out: one non-causal op block each, or the block paths under a window."""
    both = [seg for seg in segments if seg.bidirectional]
    if not both:
        return out, lse
    out, lse = out.clone(), lse.clone()  # never write into the op's own tensors
    for seg in both:
        rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
        if sees_whole(seg, feats.window):
            o, lo = op.block_forward(q[rows], k[keys], v[keys], False, feats)
            out[rows], lse[:, rows] = o.to(out.dtype), lo.float()
        else:
            _forward_groups(q, k, v, segment_blocks(seg, feats.window), feats, out, lse)
    return out, lse


@float32_inside
def doc_causal_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
    kernel: AttentionKernel | Kernel = TORCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every segment's queries to its keys.

    q: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]`` / ``[Lk, Hkv, Dv]`` with ``Hq % Hkv == 0``
    (GQA: query head ``h`` uses KV head ``h // (Hq // Hkv)``). Segments must cover every
    query row exactly once and name every key the rows may see (sinks join last, so pass
    them only with the whole set).
    Returns ``out [Lq, Hq, Dv]`` and ``lse [Hq, Lq]`` (float32). ``kernel``: the resolved
    kernel (its fused ops wherever they apply, the block paths otherwise).
    """
    feats = as_features(features)
    op = fused_for(kernel, q, feats, v)
    if op is not None:
        causal = [seg for seg in segments if not seg.bidirectional]
        out, lse = op.varlen_forward(q, k, v, causal, feats)
        out, lse = _merge_prefix_blocks(q, k, v, segments, feats, out, lse, op)
        out, lse = _bidirectional_rows(q, k, v, segments, feats, out, lse, op)
        return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
    whole = whole_block(segments, q.shape[0], feats.window)
    if whole is not None:
        # One causal block covers everything: hand back the kernel's own tensors instead of
        # copying them into preallocated ones (which would briefly hold both).
        o, lo = block_forward(bhld(q), bhld(k[whole]), bhld(v[whole]),
                              _whole_causal_block(whole), feats)
        out, lse = lhd(o), lo[0].float()
        return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
    out = out_like(q, v)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    groups = (g for seg in segments for g in segment_blocks(seg, feats.window))
    _forward_groups(q, k, v, groups, feats, out, lse)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


@float32_inside
def doc_causal_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: Sequence[Segment],
    features: AttentionFeatures | float,
    kernel: AttentionKernel | Kernel = TORCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`doc_causal_forward`: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``.

    ``out``/``lse`` are what the forward returned (after sinks, if any). Keys no segment reads
    get a zero gradient; keys read by several segments accumulate. ``kernel`` as in forward.
    """
    feats = as_features(features)
    op = fused_for(kernel, q, feats, v)
    if op is not None:
        causal = [seg for seg in segments if not seg.bidirectional]
        dq, dk, dv = op.varlen_backward(dout, q, k, v, out, lse, causal, feats)
        for seg in (seg for seg in segments if seg.bidirectional):
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
            dq[rows] = 0  # rows the op's causal call did not cover
            if sees_whole(seg, feats.window):
                dq1, dk1, dv1 = op.block_backward(dout[rows], q[rows], k[keys], v[keys],
                                                  out[rows], lse[:, rows], False, feats)
                dq[rows] += dq1
                dk[keys] += dk1
                dv[keys] += dv1
            else:
                _backward_groups(dout, q, k, v, out, lse, segment_blocks(seg, feats.window),
                                 feats, dq, dk, dv)
        for seg in (seg for seg in segments if seg.has_prefix):
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.p_start, seg.p_end)
            dq1, dk1, dv1 = op.block_backward(dout[rows], q[rows], k[keys], v[keys], out[rows],
                                              lse[:, rows], False, feats)
            dq[rows] += dq1
            dk[keys] += dk1
            dv[keys] += dv1
        return dq, dk, dv
    whole = whole_block(segments, q.shape[0], feats.window)
    if whole == slice(0, k.shape[0]):
        # Every key is read by the one causal block: its gradients are the whole dk, dv.
        dq1, dk1, dv1 = block_backward(
            bhld(dout), bhld(q), bhld(k), bhld(v), bhld(out), lse.unsqueeze(0).contiguous(),
            _whole_causal_block(whole), feats,
        )
        return lhd(dq1), lhd(dk1), lhd(dv1)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    groups = (g for seg in segments for g in segment_blocks(seg, feats.window))
    _backward_groups(dout, q, k, v, out, lse, groups, feats, dq, dk, dv)
    return dq, dk, dv


@float32_inside
def pieces_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Piece],
    features: AttentionFeatures | float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    kernel: AttentionKernel | Kernel = TORCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q`` over one key block: ``out [Lq, Hq, D]`` (float32), ``lse``.

    Rows no piece reaches get ``out = 0`` and ``lse = -inf`` (they merge as "no keys").
    Given ``out`` / ``lse`` (results over other keys), the block is merged into them in place.
    ``kernel``: the resolved kernel; the pieces run on its fused ops where they apply.
    """
    feats = as_features(features)
    if out is None or lse is None:
        out = out_like(q, v, torch.float32, 0.0)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    op = fused_for(kernel, q, feats, v)
    calls = None if op is None else piece_flash_calls(pieces, feats.window)
    if calls is not None:
        for r0, r1, k0, k1, causal in calls:  # a row may be in two pieces: merge
            o, lo = op.block_forward(q[r0:r1], k[k0:k1], v[k0:k1], causal, feats)
            m_o, m_l = merge_f32(out[r0:r1].transpose(0, 1), lse[:, r0:r1],
                                 o.transpose(0, 1).float(), lo)
            out[r0:r1], lse[:, r0:r1] = m_o.transpose(0, 1), m_l
        return out, lse
    groups = (g for piece in pieces for g in piece_blocks(piece, feats.window))
    # A zigzag block holds two runs of keys: one row may be in two pieces, so merge.
    _forward_groups(q, k, v, groups, feats, out, lse, accumulate=True)
    return out, lse


@float32_inside
def pieces_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pieces: Sequence[Piece],
    features: AttentionFeatures | float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kernel: AttentionKernel | Kernel = TORCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key block's share, given the rows' fully merged ``out`` and ``lse``.

    ``grads``: ``(dq, dk, dv)`` accumulators (e.g. float32) to add into instead of new ones.
    ``kernel`` as in :func:`pieces_forward` (the same calls, so the same split).
    """
    feats = as_features(features)
    if grads is None:
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    dq, dk, dv = grads
    op = fused_for(kernel, q, feats, v)
    calls = None if op is None else piece_flash_calls(pieces, feats.window)
    if calls is not None:
        for r0, r1, k0, k1, causal in calls:
            dq1, dk1, dv1 = op.block_backward(dout[r0:r1], q[r0:r1], k[k0:k1], v[k0:k1],
                                              out[r0:r1], lse[:, r0:r1], causal, feats)
            dq[r0:r1] += dq1
            dk[k0:k1] += dk1
            dv[k0:k1] += dv1
        return dq, dk, dv
    groups = (g for piece in pieces for g in piece_blocks(piece, feats.window))
    _backward_groups(dout, q, k, v, out, lse, groups, feats, dq, dk, dv)
    return dq, dk, dv


class DocCausalAttention(torch.autograd.Function):
    """Differentiable :func:`doc_causal_forward` (sinks get a gradient too)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, segments, feats, kernel):  # type: ignore[override]
        out, lse = doc_causal_forward(q, k, v, segments, feats, sinks, kernel)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.segments = segments
        ctx.feats = feats
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = doc_causal_backward(
            dout, q, k, v, out, lse, ctx.segments, ctx.feats, ctx.kernel
        )
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None, None


def doc_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
    kernel: AttentionKernel | Kernel = TORCH,
    prefixes: tuple[tuple[int, int, int], ...] = (),
    bidirectional: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """Differentiable document-causal attention over a full packed row.

    q: ``[T, Hq, D]``, k/v: ``[T, Hkv, D]``; documents are ``cu_seqlens[i]:cu_seqlens[i+1]``;
    ``sinks`` ``[Hq]`` (optional) gets a gradient too; ``kernel``: the resolved kernel (or its
    name); ``prefixes``: the row's branch documents (`SPMeta.prefixes`); ``bidirectional``:
    its image runs whose tokens see each other both ways (`SPMeta.bidirectional`).
    """
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    segments = full_row_segments(bounds, prefixes, bidirectional)
    return DocCausalAttention.apply(q, k, v, sinks, segments, as_features(features),
                                    as_kernel(kernel))

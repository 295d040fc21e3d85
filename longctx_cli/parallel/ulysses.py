"""Ulysses (all-to-all) sequence parallelism.

Each rank of a group of ``N`` holds ``[local_tokens, H, D]``. An all-to-all trades tokens for
heads: afterwards every rank holds the whole group's tokens for its share of the heads,
attends over them with ordinary document-causal attention (no communication inside
attention), and a second all-to-all gives every rank its own tokens back for all heads.

The gathered tokens are put in ascending global order. For a plain Ulysses group that is
the whole row in true order (zigzag chunks are reordered); for a Ulysses group inside a
hybrid SP group it is the group's share of the row, which :mod:`.ulysses_ring` feeds to a ring.

Both all-to-alls are linear maps that are each other's transpose, so each one's backward
is the other one's forward: gradients are exact.

Shares (:func:`~longctx_cli.layout.head_split`): ``H / N`` heads each when the heads divide;
otherwise whole KV-head groups, dealt out as evenly as they go (9 heads over 3 KV heads at
``N`` = 2: 6 and 3), by an all-to-all with split sizes. GQA: when the group is larger than the
number of KV heads, every KV head is replicated so that each rank receives one whole KV head
and a share of its query heads; autograd sums the replicas' gradients back. Every rank holds
at least one query head.

Head chunks (``Layout.head_chunks`` > 1): the heads are cut into chunks of whole KV-head
groups and the all-to-all, attention and the return all-to-all run one chunk at a time,
forward and backward, so only one chunk's tensors exist in the head layout at once. The
backward moves the chunk's q, k, v and output to the head layout again instead of keeping
every head there from the forward. Each chunk is an ordinary Ulysses of fewer heads, so the
result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from longctx_cli.layout import HeadSplit, head_chunk_counts, head_split

from .block_geometry import full_row_segments
from .features import (
    AttentionFeatures,
    Segment,
    as_features,
    owns_dense_storage,
    writable_inputs,
)
from .lse_merge import sink_grad
from .ring_flash import equal_head_dims, flash_window, refuse_flash_sinks
from .sharding import SPMeta, local_ranges
from .torch_kernel import DocCausalAttention, doc_causal_backward, doc_causal_forward


@dataclass(frozen=True)
class Exchange:
    """How one all-to-all group moves a row between the token and the head layout.

    ``order[i]`` is the index, in the rank-ordered all-to-all buffer, of the ``i``-th piece of
    the head layout (pieces sorted by global position). ``starts`` are those sorted pieces'
    global start offsets.
    """

    group: ProcessGroup | None
    size: int
    member: int  # this rank's index in the group
    piece_len: int
    order: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def identity(self) -> bool:
        return self.order == tuple(range(len(self.order)))


def build_exchange(meta: SPMeta, group: ProcessGroup | None, size: int) -> Exchange:
    """The exchange of the all-to-all group of ``size`` consecutive SP ranks holding this rank.

    Built once per row (``meta.derived``) because every layer of the row uses the same one.
    """
    return meta.derived(_new_exchange, group, size)


def _new_exchange(meta: SPMeta, group: ProcessGroup | None, size: int) -> Exchange:
    ctx = meta.ctx
    first = ctx.sp_rank // size * size  # groups are consecutive SP ranks (see mesh.py)
    pieces = [
        rng
        for member in range(first, first + size)
        for rng in local_ranges(meta.total_len, replace(ctx, sp_rank=member))
    ]
    lengths = {b - a for a, b in pieces}
    if len(lengths) != 1:
        raise ValueError(f"unequal sequence pieces {pieces}; cannot exchange them")
    order = tuple(sorted(range(len(pieces)), key=lambda i: pieces[i][0]))
    return Exchange(
        group=group,
        size=size,
        member=ctx.sp_rank - first,
        piece_len=lengths.pop(),
        order=order,
        starts=tuple(pieces[i][0] for i in order),
    )


# An all-to-all needs a second buffer the size of what it moves (the send copy in one
# direction, the receive buffer in the other) beside the tensor it makes; in the recomputed
# attention that buffer sits on top of the layer's largest moment. Moving the tokens in chunks
# keeps it to a chunk; a chunk of at least a MiB still moves enough to use the link.
EXCHANGE_MAX_CHUNKS = 4
EXCHANGE_MIN_CHUNK_BYTES = 2**20


def exchange_chunks(x: torch.Tensor) -> int:
    """How many token chunks the all-to-all of ``x`` (``[tokens, heads, dim]``) is split into.

    Depends only on the shape and dtype, which every rank of a group shares.
    """
    whole = x.numel() * x.element_size()
    return max(1, min(EXCHANGE_MAX_CHUNKS, whole // EXCHANGE_MIN_CHUNK_BYTES, x.shape[0]))


def _chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    cuts = [length * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in pairwise(cuts) if b > a]


def _segments(ex: Exchange, length: int, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """Where tokens ``a:b`` of each group rank's share sit in the head layout.

    Returns ``(rank, lo, hi, start)``: that rank's tokens ``a+lo : a+hi`` are rows
    ``start : start+hi-lo`` of the head layout (pieces in ascending global order).
    """
    inverse = [0] * len(ex.order)
    for pos, src in enumerate(ex.order):
        inverse[src] = pos
    size = ex.piece_len
    found = []
    for rank in range(ex.size):
        first, end = rank * length + a, rank * length + b  # in the rank-ordered buffer
        pos = first
        while pos < end:
            piece = pos // size
            stop = min(end, (piece + 1) * size)
            start = inverse[piece] * size + pos - piece * size
            found.append((rank, pos - first, stop - first, start))
            pos = stop
    return found


def _even(heads: int, n: int) -> tuple[int, ...]:
    return (heads // n,) * n


def _seq_to_heads(x: torch.Tensor, ex: Exchange, chunks: int | None = None,
                  counts: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[L, H, D]`` (own tokens, all heads) -> ``[size*L, counts[member], D]`` (group tokens).

    ``counts``: the consecutive heads each group rank keeps (``None``: ``H / size`` each)."""
    n = ex.size
    length, heads, dim = x.shape
    counts = counts or _even(heads, n)
    mine = counts[ex.member]
    even = len(set(counts)) == 1
    # Block j of what is sent holds head slice j, which is what group rank j keeps.
    by_rank = x.reshape(length, n, mine, dim) if even else None
    out = x.new_empty(n * length, mine, dim)
    bounds = _chunk_bounds(length, chunks or exchange_chunks(x))
    for a, b in bounds:
        if by_rank is not None:
            send, splits = by_rank[a:b].transpose(0, 1).contiguous(), None
        else:
            send, splits = _uneven_blocks(x[a:b], counts)
        if len(bounds) == 1 and ex.identity:  # the received blocks are already the layout
            dist.all_to_all_single(out.view(n, length, mine, dim), send,
                                   input_split_sizes=splits, group=ex.group)
            break
        recv = x.new_empty(n, b - a, mine, dim)
        dist.all_to_all_single(recv, send, input_split_sizes=splits, group=ex.group)
        for rank, lo, hi, start in _segments(ex, length, a, b):
            out[start : start + hi - lo] = recv[rank, lo:hi]
        del send, recv
    return out


def _uneven_blocks(x: torch.Tensor, counts: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    """``[T, H, D]`` as one flat buffer of blocks ``[T, counts[j], D]``, and the blocks' sizes."""
    tokens, _, dim = x.shape
    splits = [tokens * c * dim for c in counts]
    flat = x.new_empty(sum(splits))
    start = 0
    for block, c in zip(flat.split(splits), counts, strict=True):
        block.view(tokens, c, dim).copy_(x[:, start : start + c])
        start += c
    return flat, splits


def _heads_to_seq(y: torch.Tensor, ex: Exchange, chunks: int | None = None,
                  counts: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    n = ex.size
    total, mine, dim = y.shape
    length = total // n
    counts = counts or (mine,) * n
    heads = sum(counts)
    even = len(set(counts)) == 1
    out = y.new_empty(length, heads, dim)
    bounds = _chunk_bounds(length, chunks or exchange_chunks(y))
    for a, b in bounds:
        if len(bounds) == 1 and ex.identity and y.is_contiguous():
            send = y.view(n, length, mine, dim)  # already in blocks by destination
        else:
            send = y.new_empty(n, b - a, mine, dim)
            for rank, lo, hi, start in _segments(ex, length, a, b):
                send[rank, lo:hi] = y[start : start + hi - lo]
        if even:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=ex.group)
            # recv[j] is this rank's tokens for group rank j's heads: put heads back in order.
            out.view(length, n, mine, dim)[a:b] = recv.transpose(0, 1)
        else:
            splits = [(b - a) * c * dim for c in counts]
            recv = y.new_empty(sum(splits))
            dist.all_to_all_single(recv, send, output_split_sizes=splits, group=ex.group)
            start = 0
            for block, c in zip(recv.split(splits), counts, strict=True):
                out[a:b, start : start + c] = block.view(b - a, c, dim)
                start += c
        del send, recv
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex, counts):  # type: ignore[override]
        ctx.ex, ctx.counts = ex, counts
        return _seq_to_heads(x, ex, counts=counts)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _heads_to_seq(grad, ctx.ex, counts=ctx.counts), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, ex, counts):  # type: ignore[override]
        ctx.ex, ctx.counts = ex, counts
        return _heads_to_seq(y, ex, counts=counts)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _seq_to_heads(grad, ctx.ex, counts=ctx.counts), None, None


def _head_view(x: torch.Tensor, ex: Exchange, heads_major: bool) -> torch.Tensor:
    """The ``[size*L, H/size, D]`` head layout over the elements of ``[L, H, D]`` ``x``: a view
    when ``x`` is contiguous token-major (``heads_major`` False) or heads-major (True)."""
    length, heads, dim = x.shape
    n = ex.size
    if heads_major:
        return x.transpose(0, 1).reshape(heads // n, n * length, dim).transpose(0, 1)
    return x.reshape(n * length, heads // n, dim)


class _SeqToHeadsInPlace(torch.autograd.Function):
    """:func:`_seq_to_heads` written over the input's own memory (see :func:`seq_to_heads`)."""

    @staticmethod
    def forward(ctx, x, ex):  # type: ignore[override]
        ctx.ex, ctx.heads_major = ex, not x.is_contiguous()
        heads = _seq_to_heads(x, ex)
        _head_view(x, ex, ctx.heads_major).copy_(heads)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _heads_to_seq(_head_view(grad, ctx.ex, ctx.heads_major), ctx.ex), None


def seq_to_heads(x: torch.Tensor, ex: Exchange, spent: bool = False,
                 counts: tuple[int, ...] | None = None) -> torch.Tensor:
    """Differentiable ``[L, H, D] -> [size*L, H/size, D]``, tokens in ascending global order.

    ``counts``: the heads each group rank keeps, when they differ (:class:`HeadSplit`).
    ``spent``: the caller reads ``x`` no more, so when ``x`` is the whole of its storage the
    head layout is written over it (autograd's version counter still guards any saved use).
    In a layer of a Hugging Face model the frame keeps q, k and v alive until the layer
    returns; written over, they are not held twice through attention and the output
    projection, which is where the layer's memory peaks. Only an even split fits there.
    """
    if ex.size == 1:
        return x
    if counts is not None and len(set(counts)) == 1:
        counts = None
    if spent and counts is None and owns_dense_storage(x):
        heads_major = not x.is_contiguous()
        return _head_view(_SeqToHeadsInPlace.apply(x, ex), ex, heads_major)
    return _SeqToHeads.apply(x, ex, counts)


def heads_to_seq(y: torch.Tensor, ex: Exchange, counts: tuple[int, ...] | None = None
                 ) -> torch.Tensor:
    """Differentiable inverse of :func:`seq_to_heads` (``counts`` as there)."""
    if ex.size == 1:
        return y
    return _HeadsToSeq.apply(y, ex, counts)


def replicate_kv(x: torch.Tensor, split: HeadSplit) -> torch.Tensor:
    """``[L, H_kv, D]`` with every KV head repeated for the ranks it goes to (``split.kv_index``
    order); autograd sums the replicas' gradients back."""
    if not split.replicated:
        return x
    if split.even:
        return x.repeat_interleave(len(split.kv_index) // x.shape[1], dim=1)
    return x.index_select(1, torch.tensor(split.kv_index, device=x.device))


def heads_to_ranks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ex: Exchange, spent: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-to-all q, k, v to the head layout by :func:`head_split`, replicating KV heads when
    there are fewer than ranks.

    Group rank ``j`` receives consecutive query heads and exactly the KV heads they use
    (query head ``h`` uses KV head ``h // (H / H_kv)``); with replicas, KV head ``j``'s copies
    sit next to each other in ``split.kv_index`` order, one per rank that holds its queries.
    ``spent`` as in :func:`seq_to_heads`, for three tensors of their own memory.
    """
    split = head_split(q.shape[1], k.shape[1], ex.size)
    k, v = replicate_kv(k, split), replicate_kv(v, split)
    storages = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    spent = spent and len(storages) == 3
    return (seq_to_heads(q, ex, spent, split.q_counts),
            seq_to_heads(k, ex, spent, split.kv_counts),
            seq_to_heads(v, ex, spent, split.kv_counts))


def _q_counts(q: torch.Tensor, k: torch.Tensor, ex: Exchange) -> tuple[int, ...]:
    return head_split(q.shape[1], k.shape[1], ex.size).q_counts


def local_head_slice(q_heads: int, kv_heads: int, ex: Exchange) -> slice:
    """Query heads this rank holds after :func:`heads_to_ranks`."""
    return head_split(q_heads, kv_heads, ex.size).q_slice(ex.member)


def _flash_full_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    feats: AttentionFeatures,
) -> torch.Tensor:
    """flash-attn varlen over the whole row (CUDA); imported lazily, it is a GPU extra."""
    from flash_attn import flash_attn_varlen_func

    cu = meta.derived(_device_cu_seqlens, q.device)
    max_len = meta.max_seqlen
    q, k, v, v_dim = equal_head_dims(q, k, v)  # after the all-to-all: nothing padded travels
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, max_len, max_len, dropout_p=0.0, softmax_scale=feats.scale,
        causal=True, window_size=flash_window(feats), softcap=feats.softcap or 0.0,
    )
    return out[..., :v_dim]


def _device_cu_seqlens(meta: SPMeta, device: torch.device) -> torch.Tensor:
    return meta.cu_seqlens.to(device=device, dtype=torch.int32)  # once per row


def _row_segments(meta: SPMeta) -> tuple[Segment, ...]:
    """The whole row's segments, which every rank holds after the all-to-all (once per row)."""
    return full_row_segments(meta.cu_host, meta.prefixes, meta.bidirectional)


def usable_head_chunks(wanted: int, q_heads: int, kv_heads: int, size: int) -> int:
    """The largest count of :func:`head_chunk_counts` not above ``wanted`` (a layer whose
    heads differ from the plan's runs the nearest count its heads allow; 1 always fits)."""
    return max(c for c in [1, *head_chunk_counts(q_heads, kv_heads, size)] if c <= wanted)


def _chunk_slices(q_heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    hq, hk = q_heads // chunks, kv_heads // chunks
    return [(slice(c * hq, (c + 1) * hq), slice(c * hk, (c + 1) * hk)) for c in range(chunks)]


def _chunk_to_heads(x: torch.Tensor, heads: slice, split: HeadSplit, ex: Exchange,
                    kv: bool) -> torch.Tensor:
    """Heads ``heads`` of ``[L, H, D]`` ``x`` in the head layout of the chunk's ``split``
    (``kv``: KV heads, replicated as it says; not differentiable: :class:`_HeadChunkedUlysses`
    writes its own backward)."""
    part = x[:, heads]
    if kv:
        part = replicate_kv(part, split)
    counts = split.kv_counts if kv else split.q_counts
    return _seq_to_heads(part.contiguous(), ex, counts=counts)


def _kv_grad_back(grad: torch.Tensor, split: HeadSplit, ex: Exchange) -> torch.Tensor:
    """A chunk's KV-head gradient back in the token layout, the replicas' gradients summed
    (as the backward of :func:`replicate_kv` sums them)."""
    back = _heads_to_seq(grad, ex, counts=split.kv_counts)  # [L, sent KV heads, D]
    if not split.replicated:
        return back
    kv = len(set(split.kv_index))
    index = torch.tensor(split.kv_index, device=back.device)
    return back.new_zeros(back.shape[0], kv, back.shape[2]).index_add_(1, index, back)


class _HeadChunkedUlysses(torch.autograd.Function):
    """Ulysses attention one head chunk at a time; saves q, k, v and the output in the token
    layout (which the layer holds anyway) and the chunks' log-sum-exps."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ex, segments, feats, kernel, chunks):  # type: ignore[override]
        split = head_split(q.shape[1] // chunks, k.shape[1] // chunks, ex.size)
        slices = _chunk_slices(q.shape[1], k.shape[1], chunks)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lses = []
        for qs, ks in slices:
            qh = _chunk_to_heads(q, qs, split, ex, kv=False)
            kh, vh = (_chunk_to_heads(t, ks, split, ex, kv=True) for t in (k, v))
            local = None if sinks is None else sinks[_local_sink_slice(qs, split, ex)]
            oh, lse = doc_causal_forward(qh, kh, vh, segments, feats, local, kernel)
            del qh, kh, vh
            out[:, qs] = _heads_to_seq(oh, ex, counts=split.q_counts)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, sinks, *lses)
        # Spent inputs of their own memory take their gradients in place, chunk by chunk.
        ctx.in_place = writable_inputs(feats, q, k, v)
        ctx.ex, ctx.segments, ctx.feats, ctx.kernel = ex, segments, feats, kernel
        ctx.slices, ctx.split = slices, split
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, sinks, *lses = ctx.saved_tensors
        ex, split = ctx.ex, ctx.split
        if ctx.in_place:  # a chunk's heads are read before they are written
            dq, dk, dv = q.detach(), k.detach(), v.detach()
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        for (qs, ks), lse in zip(ctx.slices, lses, strict=True):
            qh, oh, doh = (_chunk_to_heads(t, qs, split, ex, kv=False) for t in (q, out, dout))
            kh, vh = (_chunk_to_heads(t, ks, split, ex, kv=True) for t in (k, v))
            dqh, dkh, dvh = doc_causal_backward(doh, qh, kh, vh, oh, lse, ctx.segments,
                                                ctx.feats, ctx.kernel)
            if dsinks is not None:
                mine = _local_sink_slice(qs, split, ex)
                dsinks[mine] = sink_grad(doh, oh, lse, sinks[mine])
            del qh, kh, vh, oh, doh
            dq[:, qs] = _heads_to_seq(dqh, ex, counts=split.q_counts)
            dk[:, ks] = _kv_grad_back(dkh, split, ex)
            dv[:, ks] = _kv_grad_back(dvh, split, ex)
        return dq, dk, dv, dsinks, None, None, None, None, None


def _local_sink_slice(heads: slice, split: HeadSplit, ex: Exchange) -> slice:
    """The query heads of chunk ``heads`` this rank holds."""
    mine = split.q_slice(ex.member)
    return slice(heads.start + mine.start, heads.start + mine.stop)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact document-causal attention of this rank's tokens by head-parallel all-to-all.

    q: ``[local_tokens, H, D]``, k/v: ``[local_tokens, H_kv, D]``; returns ``[local_tokens, H, D]``.
    ``sinks`` ``[H]`` (optional): this rank applies the slice of the heads it holds. The
    whole row's attention runs on the state's resolved kernel (``meta.ctx.kernel``).
    """
    ctx = meta.ctx
    feats = as_features(features)
    ex = build_exchange(meta, ctx.sp_group, ctx.layout.sp)
    chunks = usable_head_chunks(ctx.layout.head_chunks, q.shape[1], k.shape[1], ex.size)
    if chunks > 1:
        return _HeadChunkedUlysses.apply(q, k, v, sinks, ex, meta.derived(_row_segments),
                                         feats, ctx.kernel, chunks)
    qh, kh, vh = heads_to_ranks(q, k, v, ex, feats.spent)
    mine = local_head_slice(q.shape[1], k.shape[1], ex)
    local_sinks = None if sinks is None else sinks[mine]
    out = DocCausalAttention.apply(qh, kh, vh, local_sinks, meta.derived(_row_segments), feats,
                                   ctx.kernel)
    return heads_to_seq(out, ex, _q_counts(q, k, ex))


def flash_ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``flash`` kernel's Ulysses: flash-attn's varlen function over the whole row after
    the all-to-all. flash-attn takes neither shared pair prompts nor image runs: such rows
    run :func:`ulysses_attention` (on PyTorch's flash op)."""
    if meta.prefixes or meta.bidirectional:
        return ulysses_attention(q, k, v, meta, features, sinks)
    ctx = meta.ctx
    feats = as_features(features)
    ex = build_exchange(meta, ctx.sp_group, ctx.layout.sp)
    refuse_flash_sinks(sinks)
    chunks = usable_head_chunks(ctx.layout.head_chunks, q.shape[1], k.shape[1], ex.size)
    if chunks == 1:
        qh, kh, vh = heads_to_ranks(q, k, v, ex, feats.spent)
        return heads_to_seq(_flash_full_row(qh, kh, vh, meta, feats), ex, _q_counts(q, k, ex))
    outs = []  # flash-attn keeps each chunk's head layout for that chunk's backward
    for qs, ks in _chunk_slices(q.shape[1], k.shape[1], chunks):
        parts = q[:, qs], k[:, ks], v[:, ks]
        qh, kh, vh = heads_to_ranks(*parts, ex)
        outs.append(heads_to_seq(_flash_full_row(qh, kh, vh, meta, feats), ex,
                                 _q_counts(*parts[:2], ex)))
        del qh, kh, vh
    return torch.cat(outs, dim=1)

"""Split one packed row across an SP group, with global label shift and attention metadata.

Layouts for an SP group of size ``N`` and a padded row of ``T`` tokens:

* ``contiguous``: rank ``r`` owns ``[r*T/N, (r+1)*T/N)`` (what ring-flash-attn expects);
* ``zigzag``: the row is cut into ``2N`` chunks and rank ``r`` owns chunks ``r`` and
  ``2N-1-r``, which gives every rank the same amount of causal attention work;
* ``stripe``: token ``i`` goes to rank ``i % N`` (ring-flash-attn's stripe layout), which
  balances causal work token by token. Only the P2P ring (``batch_stripe``) computes on it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.layout import zigzag_order

from .features import Segment
from .mesh import ParallelState

T = TypeVar("T")

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; keep older releases working.
all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_sum = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class SPMeta:
    """Per-row attention metadata shared by every layer of one forward/backward pass."""

    ctx: ParallelState
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], global, from the padded full row
    total_len: int  # padded full row length
    local_ranges: tuple[tuple[int, int], ...]  # global [start, end) runs owned, in local order
    segments: tuple[Segment, ...]  # local queries -> global keys, for the torch kernels
    # cu_seqlens as host ints, read once from the CPU row: layers never read the (device)
    # tensor back, which would stall the GPU once per layer.
    cu_host: tuple[int, ...] = ()
    # (document start, prefix start, prefix end), global, of every document that branches
    # off the first tokens of an earlier one (a preference pair's answers sharing the
    # prompt): its queries also see every key of that prefix. Empty for ordinary rows.
    prefixes: tuple[tuple[int, int, int], ...] = ()
    # Global [start, end) runs of tokens that attend to each other both ways on top of the
    # causal mask (Gemma 3's image tokens, see runtime/vision.py); empty for most rows.
    # Only Ulysses computes them: after its all-to-all a rank holds the whole row.
    bidirectional: tuple[tuple[int, int], ...] = ()
    # Those runs attend both ways on sliding-window layers only, causally on the others
    # (Gemma 4's `use_bidirectional_attention: vision`): see `causal_meta`.
    bidirectional_sliding_only: bool = False
    # Mllama's cross-attention layers (parallel/cross_attention.py): `[local_tokens]` 1 where
    # the token's document holds images, 0 where the model's own forward of that document
    # skips those layers (a document without images). None: the row has no cross attention.
    cross_rows: torch.Tensor | None = None
    # Global start of each input row of the model's own training that this row concatenates
    # (a micro-batch's dataset rows, runtime/batches.py): where an index "in the forward's
    # input" counts from (Llama 4's temperature tuning). None: longctx does not know them.
    row_starts: tuple[int, ...] | None = None
    # Values derived from this row, built once and read by every layer (see `derived`).
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    attention_calls: int = 0  # incremented by the transformers entry point
    token_mixer_calls: int = 0  # incremented by the covered token mixers (token_mixing.py)

    @property
    def went_through_sp(self) -> bool:
        """Some layer of the forward ran sequence-parallel: attention, or a covered token
        mixer (a model of scans alone, e.g. a Bamba stack without attention layers)."""
        return self.attention_calls > 0 or self.token_mixer_calls > 0

    @property
    def max_seqlen(self) -> int:
        """The longest document (or padding tail) of the row."""
        return max(b - a for a, b in zip(self.cu_host[:-1], self.cu_host[1:], strict=True))

    @property
    def local_len(self) -> int:
        return self.total_len // self.ctx.layout.sp

    def derived(self, build: Callable[..., T], *args: Hashable) -> T:
        """``build(self, *args)``, computed once per row: every layer of the row needs the same
        value. The key is the builder and its arguments, so two builders never collide."""
        key = (build, *args)
        if key not in self._derived:
            self._derived[key] = build(self, *args)
        return self._derived[key]


@dataclass
class ShardedBatch:
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], global positions (restart at 0 per document)
    shift_labels: torch.Tensor  # [1, L], target of each local token, -100 = no loss
    sp_meta: SPMeta
    num_documents: int = 0  # documents in the row before padding (pairs: twice the pairs)
    rows: tuple[int, ...] = ()  # the dataset rows collated into this batch, in order
    # The next token of each local token within its document, -100 at a document's end;
    # only when asked for (`rl: orpo` scores the chosen prompt too), else None.
    next_tokens: torch.Tensor | None = None
    # A vision-language row's whole-row part (`runtime.vision.WholeRow`: ids, text
    # positions, images), which every rank of the group needs; None for text rows.
    vision: Any = None


def zigzag_positions(n: int) -> list[int]:
    """Inverse of :func:`zigzag_order`: where global chunk ``j`` sits in rank order."""
    where = [0] * (2 * n)
    for i, c in enumerate(zigzag_order(n)):
        where[c] = i
    return where


def local_ranges(total_len: int, ctx: ParallelState) -> tuple[tuple[int, int], ...]:
    """Global token ranges this rank owns, in the order they are stored locally."""
    return ctx.local_ranges(total_len)


def segments_for(cu_seqlens: list[int], ranges: tuple[tuple[int, int], ...],
                 prefixes: tuple[tuple[int, int, int], ...] = ()) -> tuple[Segment, ...]:
    """Split the owned ranges at document boundaries: one segment per (range, document) piece.

    Query indices are local rows; key indices are global, so a segment's keys start at the
    start of its document, which may live on another rank (and, for a branch document, its
    prefix's keys, see `SPMeta.prefixes`).
    """
    shared = {start: (p0, p1) for start, p0, p1 in prefixes}
    out: list[Segment] = []
    offset = 0
    for g0, g1 in ranges:
        # Only the documents overlapping [g0, g1): a stripe layout has T/N one-token ranges.
        d = bisect_right(cu_seqlens, g0) - 1
        while d + 1 < len(cu_seqlens) and cu_seqlens[d] < g1:
            ds, de = cu_seqlens[d], cu_seqlens[d + 1]
            a, b = max(g0, ds), min(g1, de)
            if a < b:
                out.append(Segment(offset + a - g0, offset + b - g0, ds, b,
                                   *shared.get(ds, (0, 0))))
            d += 1
        offset += g1 - g0
    return tuple(out)


def slice_sequence(full: torch.Tensor, ctx: ParallelState, dim: int = 0) -> torch.Tensor:
    """This rank's part of a full-row tensor (inverse of :func:`gather_sequence`)."""
    if ctx.layout.sharding == "stripe" and ctx.layout.sp > 1:
        n = ctx.layout.sp
        if full.shape[dim] % n:
            raise ValueError(f"row length {full.shape[dim]} is not a multiple of {n}")
        return full.unflatten(dim, (full.shape[dim] // n, n)).select(dim + 1, ctx.sp_rank)
    parts = [full.narrow(dim, a, b - a) for a, b in local_ranges(full.shape[dim], ctx)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def gather_sequence(local: torch.Tensor, ctx: ParallelState, dim: int = 0) -> torch.Tensor:
    """All-gather every rank's part and return the full row in global token order.

    Not differentiable; meant for evaluation and tests.
    """
    if ctx.layout.sp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.layout.sp)]
    dist.all_gather(parts, local.contiguous(), group=ctx.sp_group)
    if ctx.layout.sharding == "contiguous":
        return torch.cat(parts, dim=dim)
    if ctx.layout.sharding == "stripe":  # token i came from rank i % N
        return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)
    stored = [half for p in parts for half in p.chunk(2, dim=dim)]  # rank order
    return torch.cat([stored[i] for i in zigzag_positions(ctx.layout.sp)], dim=dim)


def to_global_order(gathered: torch.Tensor, meta: SPMeta) -> torch.Tensor:
    """A rank-ordered all-gather output (dim 0) in global token order, for every sharding."""
    ctx = meta.ctx
    n = ctx.layout.sp
    if ctx.layout.sharding == "contiguous" or n == 1:
        return gathered
    if ctx.layout.sharding == "stripe":  # rank r's part holds tokens r, r + n, ...
        return gathered.unflatten(0, (n, -1)).transpose(0, 1).flatten(0, 1)
    stored = gathered.chunk(2 * n)
    return torch.cat([stored[i] for i in zigzag_positions(n)])


def to_rank_order(full: torch.Tensor, meta: SPMeta) -> torch.Tensor:
    """Inverse of :func:`to_global_order`: the layout a reduce-scatter expects."""
    ctx = meta.ctx
    n = ctx.layout.sp
    if ctx.layout.sharding == "contiguous" or n == 1:
        return full
    if ctx.layout.sharding == "stripe":
        return full.unflatten(0, (-1, n)).transpose(0, 1).flatten(0, 1)
    chunks = full.chunk(2 * n)
    return torch.cat([chunks[j] for j in zigzag_order(n)])


def permute_chunks_(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x`` cut into ``len(order)`` equal chunks along dim 0, rearranged in place so that
    chunk ``j`` becomes the old chunk ``order[j]``; the scratch is one chunk per cycle of the
    permutation, not a copy of ``x``. Returns ``x``."""
    chunks = x.chunk(len(order))
    done = [False] * len(order)
    for start in range(len(order)):
        if done[start] or order[start] == start:
            continue
        spare = chunks[start].clone()  # the cycle's first chunk, overwritten first
        j = start
        while order[j] != start:  # every chunk is read before it is written
            done[j] = True
            chunks[j].copy_(chunks[order[j]])
            j = order[j]
        done[j] = True
        chunks[j].copy_(spare)
        del spare
    return x


def to_global_order_(gathered: torch.Tensor, meta: SPMeta) -> torch.Tensor:
    """:func:`to_global_order` over ``gathered``'s own memory (contiguous and zigzag rows; a
    stripe row is returned as a copy). ``gathered`` must have no other reader."""
    n = meta.ctx.layout.sp
    if meta.ctx.layout.sharding == "stripe" and n > 1:
        return to_global_order(gathered, meta)
    if meta.ctx.layout.sharding == "zigzag" and n > 1:
        permute_chunks_(gathered, zigzag_positions(n))
    return gathered


def to_rank_order_(full: torch.Tensor, meta: SPMeta) -> torch.Tensor:
    """:func:`to_rank_order` over ``full``'s own memory, as :func:`to_global_order_`."""
    n = meta.ctx.layout.sp
    if meta.ctx.layout.sharding == "stripe" and n > 1:
        return to_rank_order(full, meta)
    if meta.ctx.layout.sharding == "zigzag" and n > 1:
        permute_chunks_(full, zigzag_order(n))
    return full


def document_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of a 1-D row: a segment starts at 0 and wherever the positions do
    not go on by one (a restart at 0, or a branch, see `document_prefixes`)."""
    starts = ((position_ids[1:] != position_ids[:-1] + 1) | (position_ids[1:] == 0))
    starts = starts.nonzero().flatten() + 1
    return torch.cat([starts.new_zeros(1), starts,
                      starts.new_tensor([position_ids.numel()])]).to(torch.int32)


def refuse_prefixes(meta: SPMeta, what: str) -> None:
    """Stop where a row's shared pair prompts (`prefix_sharing`) would be computed wrongly."""
    if meta.prefixes:
        raise NotImplementedError(
            f"{what} cannot compute shared pair prompts (`prefix_sharing: true`). Set "
            "`prefix_sharing: false` for this model.")


def document_prefixes(position_ids: torch.Tensor, cu_host: tuple[int, ...],
                      ) -> tuple[tuple[int, int, int], ...]:
    """The branches of a row: a document whose positions start at `s > 0` continues the first
    `s` tokens of the last document that started at 0 (its prefix, which it sees whole)."""
    out, root = [], 0
    firsts = position_ids[list(cu_host[:-1])].tolist()  # one read for the whole row
    for start, end, first in zip(cu_host[:-1], cu_host[1:], firsts, strict=True):
        if first == 0:
            root = start
            continue
        if first > end - root or root + first > start:
            raise ValueError(f"the document at {start} continues {first} tokens of the one at "
                             f"{root}, which has fewer")
        out.append((start, root, root + first))
    return tuple(out)


def shift_labels_globally(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``shift[t] = labels[t+1]``, with -100 at the row end and before every document start.

    Done once on the full row: shifting per rank would lose each rank's boundary target.
    """
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    starts = cu_seqlens[1:-1].long()
    shifted[starts - 1] = IGNORE_INDEX
    return shifted


def _pad(x: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return torch.cat([x, x.new_full((extra,), value)]) if extra else x


def padded_row(input_ids: torch.Tensor, position_ids: torch.Tensor, extra: int,
               pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D row's ids and positions with `extra` padding tokens at its end. The padding
    tail is a document of its own: positions restart at 0 there."""
    tail = torch.arange(extra, dtype=position_ids.dtype, device=position_ids.device)
    return (_pad(input_ids, extra, pad_token_id),
            torch.cat([position_ids, tail]) if extra else position_ids)


def shard_batch(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    ctx: ParallelState,
    pad_token_id: int = 0,
    next_tokens: bool = False,
    row_starts: tuple[int, ...] | None = None,
) -> ShardedBatch:
    """Pad, shift labels globally and slice one packed row for this rank (see module doc);
    `next_tokens`: also every token's successor in its document, shifted the same way;
    `row_starts`: where each of the model's own input rows starts in it (`SPMeta`)."""
    input_ids, position_ids, labels = (t.reshape(-1) for t in (input_ids, position_ids, labels))
    if not input_ids.numel() == position_ids.numel() == labels.numel():
        raise ValueError("input_ids, position_ids and labels must have the same length")
    length = input_ids.numel()
    multiple = ctx.layout.row_multiple
    extra = -length % multiple
    input_ids, position_ids = padded_row(input_ids, position_ids, extra, pad_token_id)
    labels = _pad(labels, extra, IGNORE_INDEX)
    cu_seqlens = document_cu_seqlens(position_ids)
    shifted = shift_labels_globally(labels, cu_seqlens)
    total = input_ids.numel()
    ranges = local_ranges(total, ctx)
    cu_host = tuple(cu_seqlens.tolist())  # the row is still on the host here
    # Documents before padding (the padding tail is one more).
    num_documents = len(cu_host) - 1 - (extra > 0) if length else 0
    prefixes = document_prefixes(position_ids, cu_host)
    meta = SPMeta(
        ctx=ctx,
        cu_seqlens=cu_seqlens,
        total_len=total,
        local_ranges=ranges,
        segments=segments_for(cu_host, ranges, prefixes),
        cu_host=cu_host,
        prefixes=prefixes,
        row_starts=row_starts,
    )
    batch = ShardedBatch(
        input_ids=slice_sequence(input_ids, ctx).unsqueeze(0),
        position_ids=slice_sequence(position_ids, ctx).unsqueeze(0),
        shift_labels=slice_sequence(shifted, ctx).unsqueeze(0),
        sp_meta=meta,
        num_documents=num_documents,
        next_tokens=(slice_sequence(shift_labels_globally(input_ids, cu_seqlens), ctx)
                     .unsqueeze(0) if next_tokens else None),
    )
    if ctx.layout.tp > 1:
        from .tensor_parallel import tp_batch

        batch = tp_batch(batch, ctx)
    return batch


def chunk_bounds(cu_host: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Segment bounds with every document (and the padding tail) cut into ``chunk``-token
    pieces counted from its start: chunked local attention is document-causal attention over
    these pieces."""
    out = [cu_host[0]]
    for start, end in zip(cu_host[:-1], cu_host[1:], strict=True):
        out.extend(range(start + chunk, end, chunk))
        out.append(end)
    return tuple(out)


def chunked_meta(meta: SPMeta, chunk: int) -> SPMeta:
    """``meta`` as chunked local attention sees it: chunk boundaries are segment starts.

    Built once per row and chunk size (every chunked layer of the row shares it). Labels are
    not affected (they come from documents); only attention reads these bounds, so every
    strategy and kernel that honours document boundaries honours chunks too.
    """
    return meta.derived(_new_chunked_meta, chunk)


def causal_meta(meta: SPMeta) -> SPMeta:
    """``meta`` without its both-ways image runs: what a layer whose images attend causally
    sees (Gemma 4's full-attention layers). Built once per row."""
    return meta.derived(_new_causal_meta)


def _new_causal_meta(meta: SPMeta) -> SPMeta:
    return replace(meta, bidirectional=(), bidirectional_sliding_only=False, _derived={},
                   attention_calls=0, token_mixer_calls=0)


def _new_chunked_meta(meta: SPMeta, chunk: int) -> SPMeta:
    if meta.bidirectional:
        raise ValueError("chunked local attention with bidirectional image tokens is not "
                         "supported")
    if meta.prefixes:
        raise ValueError("chunked local attention with shared pair prompts (`prefix_sharing`) "
                         "is not supported")
    bounds = chunk_bounds(meta.cu_host, chunk)
    if bounds == meta.cu_host:  # no document is longer than a chunk
        return meta
    return SPMeta(
        ctx=meta.ctx,
        cu_seqlens=torch.tensor(bounds, dtype=meta.cu_seqlens.dtype,
                                device=meta.cu_seqlens.device),
        total_len=meta.total_len,
        local_ranges=meta.local_ranges,
        segments=segments_for(bounds, meta.local_ranges),
        cu_host=bounds,
    )


def make_sp_meta(position_ids: torch.Tensor, ctx: ParallelState) -> SPMeta:
    """Metadata for a full (already padded) 1-D position row, without touching tokens."""
    position_ids = position_ids.reshape(-1)
    cu_seqlens = document_cu_seqlens(position_ids)
    cu_host = tuple(cu_seqlens.tolist())
    prefixes = document_prefixes(position_ids, cu_host)
    ranges = local_ranges(cu_host[-1], ctx)
    return SPMeta(ctx, cu_seqlens, cu_host[-1], ranges, segments_for(cu_host, ranges, prefixes),
                  cu_host=cu_host, prefixes=prefixes)

"""Ring attention as a point-to-point ring (``ring_attn_func: batch_ring | batch_zigzag |
batch_stripe``), in PyTorch on the state's resolved kernel (the ``flash`` kernel runs
ring-flash-attn's own P2P functions where they are exact, :func:`flash_p2p_ring_attention`).

Every rank of an SP group of ``N`` starts with its own K/V block. In step ``t`` it holds the
block of rank ``(r - t) mod N``: it sends that block to rank ``r + 1`` and receives the next
one from rank ``r - 1`` with one ``batch_isend_irecv`` while it computes the attention of its
queries to the block at hand. A rank therefore holds two K/V blocks (the current one and the
one in flight), never the gathered sequence. Partial results are merged exactly through
their log-sum-exp; sinks join after the last block.

Which keys of a block a local query may see is derived per (query rank, key rank) pair as
:class:`~.block_geometry.Piece` s: local query rows x this block's keys, cut at the document start
(packed rows: documents cross ranks) and by the sliding window. The layouts:

* ``contiguous`` / ``zigzag`` (``batch_ring`` / ``batch_zigzag``): runs of consecutive
  tokens; positions map to block indices by an offset, the window is unchanged;
* ``stripe`` (``batch_stripe``, token ``i`` on rank ``i % N``): query ``j`` of rank ``r`` is
  token ``jN + r``, key ``i`` of rank ``s`` is token ``iN + s``; it sees ``i <= j - e`` with
  ``e = [s > r]``, and a window ``W`` becomes ``W' = -e - floor((r - s - W) / N)`` block
  indices - the stripe layout keeps attention causal in block coordinates.

Backward sends the K/V blocks around again; each block's dK/dV accumulator (float32)
travels with it, every rank adds its queries' share, and one last hop takes it home.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import replace

import torch
import torch.distributed as dist

from .block_geometry import Piece
from .features import AttentionFeatures, as_features
from .lse_merge import apply_sinks, out_like, sink_grad
from .mesh import ParallelState
from .sharding import SPMeta, local_ranges
from .torch_kernel import pieces_backward, pieces_forward

log = logging.getLogger(__name__)


class _Ring:
    """Batched sends to the next rank and receives from the previous one of an SP group."""

    def __init__(self, ctx: ParallelState):
        n, r, group = ctx.layout.sp, ctx.sp_rank, ctx.sp_group
        self.group = group
        self.to = dist.get_global_rank(group, (r + 1) % n)
        self.frm = dist.get_global_rank(group, (r - 1) % n)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> list[dist.Work]:
        # Every rank posts its sends, then its receives, in the same order: they pair up.
        ops = [dist.P2POp(dist.isend, t, self.to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.frm, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work] | None) -> None:
    for w in works or ():
        w.wait()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _run_pieces(meta: SPMeta, src: int) -> tuple[Piece, ...]:
    """contiguous / zigzag: this rank's query runs x rank ``src``'s key runs, per document."""
    ctx = meta.ctx
    cu = meta.cu_host

    def runs(rank: int) -> list[tuple[int, int, int]]:  # (global start, end, local start)
        out, local = [], 0
        for a, b in local_ranges(meta.total_len, replace(ctx, sp_rank=rank)):
            out.append((a, b, local))
            local += b - a
        return out

    shared = {start: (p0, p1) for start, p0, p1 in meta.prefixes}
    pieces = []
    for qg0, qg1, ql in runs(ctx.sp_rank):
        for kg0, kg1, kl in runs(src):
            if kg0 >= qg1:  # every key comes after every query
                continue
            off = kl - kg0  # global position -> index in the received block
            d = bisect_right(cu, qg0) - 1
            while d + 1 < len(cu) and cu[d] < qg1:
                a, b = max(qg0, cu[d]), min(qg1, cu[d + 1])
                # A document's queries never see earlier documents, but a branch sees its
                # prefix (wholly: it lies before every query of the branch).
                for k0, k1 in ((cu[d], kg1), shared.get(cu[d], (0, 0))):
                    first, last = max(kg0, k0), min(kg1, k1)
                    if a < b and first < last and first < b:
                        pieces.append(Piece(ql + a - qg0, ql + b - qg0, a + off, first + off,
                                            last + off))
                d += 1
    return tuple(pieces)


def _stripe_pieces(
    meta: SPMeta, src: int, window: int | None
) -> tuple[tuple[Piece, ...], int | None]:
    """stripe: the pieces and the window in block coordinates (see the module doc)."""
    ctx = meta.ctx
    n, r, length = ctx.layout.sp, ctx.sp_rank, meta.local_len
    e = 1 if src > r else 0
    w = None if window is None else -e - (r - src - window) // n
    if w is not None and w <= 0:  # the window ends before any token of rank src
        return (), w
    cu = meta.cu_host
    shared = {start: (p0, p1) for start, p0, p1 in meta.prefixes}
    pieces = []
    for ds, de in zip(cu[:-1], cu[1:], strict=True):
        j0, j1 = max(0, _ceil_div(ds - r, n)), min(length, _ceil_div(de - r, n))
        if j0 < j1:
            pieces.append(Piece(j0, j1, j0 - e, max(0, _ceil_div(ds - src, n)), length))
            if ds in shared:  # a branch: its prefix's keys of rank src, all before its rows
                p0, p1 = shared[ds]
                k0, k1 = max(0, _ceil_div(p0 - src, n)), min(length, _ceil_div(p1 - src, n))
                if k0 < k1:
                    pieces.append(Piece(j0, j1, j0 - e, k0, k1))
    return tuple(pieces), w


def _new_step_geometry(
    meta: SPMeta, step: int, window: int | None
) -> tuple[tuple[Piece, ...], int | None]:
    ctx = meta.ctx
    src = (ctx.sp_rank - step) % ctx.layout.sp
    if ctx.layout.sharding == "stripe":
        return _stripe_pieces(meta, src, window)
    return _run_pieces(meta, src), window


def _warn_fallback(meta: SPMeta, why: str) -> None:
    log.warning("P2P ring on %s rows: this row runs its blocks on PyTorch's flash op, not "
                "ring-flash-attn (%s)", meta.ctx.layout.sharding, why)


def step_geometry(
    meta: SPMeta, step: int, feats: AttentionFeatures
) -> tuple[tuple[Piece, ...], AttentionFeatures]:
    """What this rank computes in ring step ``step``: pieces and features in block coordinates.

    Cached per row: every layer of the row has the same geometry.
    """
    pieces, window = meta.derived(_new_step_geometry, step, feats.window)
    if not pieces or window == feats.window:
        return pieces, feats
    return pieces, replace(feats, window=window)


class P2PRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, meta, feats):  # type: ignore[override]
        n = meta.ctx.layout.sp
        ring = _Ring(meta.ctx) if n > 1 else None
        out = out_like(q, v, torch.float32, 0.0)  # v's head dim (MLA: not q's)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        cur = (k.contiguous(), v.contiguous())
        spare = None  # the buffers received two steps ago, free once their send completed
        for step in range(n):
            pending = None
            if ring is not None and step + 1 < n:  # the next block travels while we compute
                nxt = spare or (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
                pending = ring.start(list(cur), list(nxt))
            pieces, step_feats = step_geometry(meta, step, feats)
            if pieces:  # merged into the running result in place: no per-block copy
                pieces_forward(q, cur[0], cur[1], pieces, step_feats, out, lse,
                               kernel=meta.ctx.kernel)
            if pending is not None:
                _wait(pending)
                spare = None if step == 0 else cur  # never recycle the caller's own k, v
                cur = nxt
        del cur, spare
        out = out.to(q.dtype)
        if sinks is not None:  # after every key: sinks renormalise the whole softmax
            out, lse = apply_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.meta, ctx.feats = meta, feats
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        meta, feats = ctx.meta, ctx.feats
        n = meta.ctx.layout.sp
        ring = _Ring(meta.ctx) if n > 1 else None
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = (k.contiguous(), v.contiguous())
        spare = None
        acc_works, acc_in = None, None  # the accumulator of the block arriving next
        dk = dv = None
        for step in range(n):
            kv_works = None
            if ring is not None and step + 1 < n:
                nxt = spare or (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
                kv_works = ring.start(list(cur), list(nxt))
            pieces, step_feats = step_geometry(meta, step, feats)
            block = None
            if pieces:  # dq straight into its accumulator; this block's dK/dV on their own
                block = (dq, torch.zeros_like(cur[0]), torch.zeros_like(cur[1]))
                pieces_backward(dout, q, cur[0], cur[1], out, lse, pieces, step_feats, block,
                                kernel=meta.ctx.kernel)
            # This block's dK/dV so far: from the previous rank (in flight during the compute
            # above), or zero on the block's home rank.
            if step == 0:
                acc = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                       torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
            else:
                _wait(acc_works)
                acc = acc_in
            if block is not None:
                acc[0] += block[1]
                acc[1] += block[2]
            del block
            if ring is None:
                dk, dv = acc
            else:  # pass it on with the block; after the last step that is its home rank
                acc_in = [torch.empty_like(acc[0]), torch.empty_like(acc[1])]
                acc_works = ring.start(acc, acc_in)
            if kv_works is not None:
                _wait(kv_works)
                spare = None if step == 0 else cur
                cur = nxt
        if ring is not None:
            _wait(acc_works)
            dk, dv = acc_in
        # This rank's tokens' share; the trainer sums parameter gradients over ranks.
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None


def p2p_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact document-causal attention of local ``q`` over the row, K/V passed around a ring.

    Same contract as :func:`.ring.ring_attention`: q ``[local_tokens, Hq, D]``, k/v
    ``[local_tokens, Hkv, D]`` (``Hq % Hkv == 0``), ``sinks`` ``[Hq]`` optional and
    differentiable; the layout is ``meta.ctx.layout.sharding`` (contiguous, zigzag or stripe).
    The blocks run on the state's resolved kernel (``meta.ctx.kernel``).
    """
    feats = as_features(features)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")
    return P2PRingAttention.apply(q, k, v, sinks, meta, feats)


def flash_p2p_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``flash`` kernel's P2P ring: ring-flash-attn's P2P functions run where they are
    exact (see :func:`.ring_flash.flash_p2p_unfit`); other rows, and sp 1, run
    :func:`p2p_ring_attention`, whose blocks are on PyTorch's flash op."""
    feats = as_features(features)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")
    if meta.ctx.layout.sp > 1:
        from .ring_flash import flash_p2p_attention, flash_p2p_unfit

        why = flash_p2p_unfit(q, meta, feats, sinks)
        if why is None:
            return flash_p2p_attention(q, k, v, meta, feats)
        meta.derived(_warn_fallback, why)  # once per row, not per layer
    return P2PRingAttention.apply(q, k, v, sinks, meta, feats)

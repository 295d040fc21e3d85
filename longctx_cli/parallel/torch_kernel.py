"""Local document-causal attention with log-sum-exp, in pure PyTorch.

This is the part of SP attention that has nothing to do with communication: given local
queries and a key/value tensor, attend each query block to the keys it may see inside its
own document. Strategies (ring, Ulysses) reduce their work to calls of these functions.

Work is split into *segments*: a run of consecutive query rows of one document. A segment
with queries ``q[q_start:q_end]`` whose last key is ``k_end`` attends to ``k[k_start:k_end]``
with bottom-right causal alignment (query ``q_end - 1`` sees key ``k_end - 1``): a query sits
at *key position* ``k_end - (q_end - row)``. Each segment is cut into *blocks* so that no
``T x T`` mask is ever built:

* no window (or one the segment never reaches past): the *prefix* ``k[k_start : k_end - n]``
  (``n`` = number of queries), fully visible, and the *diagonal* ``k[k_end - n : k_end]``, a
  square causal block;
* a sliding window ``W`` (query at key position ``p`` sees keys ``p - W + 1 .. p``, never
  before its document start): query rows in blocks of ``b <= W`` rows; each has a causal
  diagonal, a fully visible middle, and a left *edge* of at most ``b - 1`` keys whose
  ``b x b`` band mask is the only mask built.

The partial results are merged exactly through their log-sum-exp. The backward of each
block is computed with the merged output and log-sum-exp, which gives exact gradients.

:class:`AttentionFeatures` carries what a layer computes beyond ``softmax(q k^T * scale) v``:
the window and logit softcapping. Attention sinks (a per-head logit with no value) join after
all keys are merged: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``; the
block backward run with ``(out', lse')`` is then exact, and :func:`sink_grad` gives d sink.
Softcapping needs the scores themselves, so it (and every device without the CPU flash op)
takes the tiled matmul path, ``_TILE x _TILE`` scores at a time.

Values may have their own head dim (multi-head latent attention): outputs take v's. The CPU
flash op takes one head dim, so its calls pad the smaller side with zeros (exact).

On CUDA the ``torch_flash`` kernel (:mod:`.torch_flash`) replaces the block loop with
PyTorch's own flash-attention op over all segments at once; ``cudnn``
(:mod:`.cudnn_attention`, PyTorch's cuDNN attention ops) and ``fa4``
(:mod:`.fa4_attention`, flash-attn 4) do the same with their ops. Strategies select one by
passing ``kernel=`` to the functions below (:func:`op_kernel` resolves it per call), and only
what the ops cannot compute comes back here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from longctx_cli.kernel_choice import TILE

from . import cudnn_attention
from .fa4_attention import fa4_ops
from .features import AttentionFeatures, Segment, as_features
from .torch_flash import (
    FlashOps,
    block_backward,
    block_forward,
    flash_applies,
    flash_ops,
    pad_head_dim,
    varlen_backward,
    varlen_forward,
)

_F = TypeVar("_F", bound=Callable[..., Any])


def float32_inside(fn: _F) -> _F:
    """Run ``fn`` with autocast off on its tensors' device: the kernels compute scores,
    softmax statistics and accumulations in float32 themselves (``.float()``), and an
    enclosing fp16/bf16 autocast would silently run those matmuls in half precision."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _cpu_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash op (``[1, H, L, D]``), which needs one head dim for q, k and v.

    Multi-head latent attention (DeepSeek) has a value head dim unlike the q/k one: the
    smaller side is padded with zeros, which is exact (:func:`.torch_flash.pad_head_dim`).
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return _FWD(q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale)
    d = max(dqk, dv)
    out, lse = _FWD(pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d), 0.0, causal,
                    attn_mask=attn_mask, scale=scale)
    return out[..., :dv], lse


def _cpu_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`_cpu_fwd` (padded the same way; the padded columns' gradients are
    dropped, and zero ``dout`` columns leave the rest exact)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return _BWD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)
    d = max(dqk, dv)
    gq, gk, gv = _BWD(*(pad_head_dim(t, d) for t in (dout, q, k, v, out)), lse, 0.0, causal,
                      attn_mask=attn_mask, scale=scale)
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]


def out_like(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None,
             fill: float | None = None) -> torch.Tensor:
    """An attention output buffer: q's rows and heads, v's head dim (MLA: they differ)."""
    shape = (*q.shape[:-1], v.shape[-1])
    dtype = dtype or q.dtype
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=q.device)
    return torch.full(shape, fill, dtype=dtype, device=q.device)

class OpKernel(NamedTuple):
    """A fused kernel's four entry points (the signatures of :mod:`.torch_flash`'s)."""

    varlen_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    block_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    block_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


OP_KERNELS = ("torch_flash", "cudnn", "fa4")  # kernels whose blocks run on fused ops
_CUDNN = OpKernel(cudnn_attention.varlen_forward, cudnn_attention.varlen_backward,
                  cudnn_attention.block_forward, cudnn_attention.block_backward)


@functools.lru_cache(maxsize=8)
def _flash_kernel(ops: FlashOps) -> OpKernel:
    return OpKernel(functools.partial(varlen_forward, ops=ops),
                    functools.partial(varlen_backward, ops=ops),
                    functools.partial(block_forward, ops=ops),
                    functools.partial(block_backward, ops=ops))


def op_kernel(kernel: str, q: torch.Tensor, feats: AttentionFeatures,
              v: torch.Tensor | None = None) -> OpKernel | None:
    """The fused ops this call runs on under ``kernel``, or None for the block paths below.

    ``cudnn``: PyTorch's cuDNN ops; a call they cannot take exactly (a window, a softcap)
    goes to PyTorch's flash op where that applies (``kernel_choice`` refuses such models
    for ``cudnn``, so this is a guard, not a route). ``fa4``: flash-attn 4's functions behind
    the flash op's interface. ``torch_flash``: PyTorch's flash op.
    """
    if kernel not in OP_KERNELS:
        return None
    if kernel == "cudnn" and cudnn_attention.applies(q, feats, v):
        return _CUDNN
    ops = fa4_ops() if kernel == "fa4" else flash_ops()
    return _flash_kernel(ops) if flash_applies(q, feats, v, ops) else None


_MAX_ROWS = 512  # query rows per block under a window: bounds the edge mask to 512 x 512
_TILE = TILE  # query rows and keys per score tile of the matmul path (validate budgets it)


class _Block(NamedTuple):
    """Query rows ``[q0, q1)`` against keys ``[k0, k1)``; row ``q0`` sits at key position ``pos``.

    ``masked`` is False when every (row, key) pair is visible.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    pos: int
    masked: bool


def full_row_segments(cu_seqlens: Sequence[int] | torch.Tensor,
                      prefixes: tuple[tuple[int, int, int], ...] = (),
                      bidirectional: tuple[tuple[int, int], ...] = ()) -> tuple[Segment, ...]:
    """Segments for a full row where queries and keys are the same tokens (one per document;
    a branch document's with its prefix, see `SPMeta.prefixes`). A document holding
    `bidirectional` runs (`SPMeta.bidirectional`) is cut at them: each run is a segment
    whose queries see every key of the document up to the run's end."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    shared = {start: (p0, p1) for start, p0, p1 in prefixes}
    if not bidirectional:
        return tuple(Segment(a, b, a, b, *shared.get(a, (0, 0)))
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
    if prefixes:
        raise ValueError("bidirectional image tokens with shared pair prompts "
                         "(`prefix_sharing`) are not supported")
    out, runs = [], iter(sorted(bidirectional))
    run = next(runs, None)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cut = a
        while run is not None and run[0] < b:
            s, e = run
            if s < a or e > b:
                raise ValueError(f"bidirectional run {run} crosses a document bound ({a}, {b})")
            if cut < s:
                out.append(Segment(cut, s, a, s))
            out.append(Segment(s, e, a, e, bidirectional=True))
            cut, run = e, next(runs, None)
        if cut < b:
            out.append(Segment(cut, b, a, b))
    return tuple(out)


def _segment_blocks(seg: Segment, window: int | None) -> list[list[_Block]]:
    """The blocks of one segment, grouped by the query rows they cover (see module doc).

    In every block each row sees at least one key, so no block has an empty softmax.
    """
    n = seg.q_end - seg.q_start
    if n == 0:
        return []
    diag = seg.k_end - n
    if seg.bidirectional:
        reach = None if _sees_whole(seg, window) else window
        return _rows_seeing_to_end(seg.q_start, seg.q_end, diag, seg.k_start, seg.k_end, reach)
    if seg.has_prefix and window is not None:
        raise ValueError("sliding-window attention with shared pair prompts (`prefix_sharing`) "
                         "is not supported")
    if window is None or window >= seg.k_end - seg.k_start:  # the window clips nothing here
        blocks = [_Block(seg.q_start, seg.q_end, diag, seg.k_end, diag, True)]
        if diag > seg.k_start:
            blocks.append(_Block(seg.q_start, seg.q_end, seg.k_start, diag, diag, False))
        if seg.has_prefix:  # a branch: the shared prefix is visible to every row
            blocks.append(_Block(seg.q_start, seg.q_end, seg.p_start, seg.p_end, diag, False))
        return [blocks]
    rows = min(window, _MAX_ROWS)  # <= window: the diagonal stays plain causal
    groups = []
    for r0 in range(seg.q_start, seg.q_end, rows):
        r1 = min(r0 + rows, seg.q_end)
        p0 = diag + r0 - seg.q_start
        p1 = p0 + r1 - r0
        blocks = [_Block(r0, r1, p0, p1, p0, True)]
        full0 = max(seg.k_start, p1 - window)  # the last row's first key
        if full0 < p0:
            blocks.append(_Block(r0, r1, full0, p0, p0, False))
        edge0 = max(seg.k_start, p0 - window + 1)  # the first row's first key
        if edge0 < full0:  # the last row sees none of the edge, every other row some
            blocks.append(_Block(r0, r1 - 1, edge0, full0, p0, True))
        groups.append(blocks)
    return groups


class Piece(NamedTuple):
    """Query rows ``[q0, q1)`` at key positions ``pos0 ..`` against keys ``[k0, k1)``.

    The generalisation of :class:`Segment` a P2P ring needs: the keys are one rank's block,
    so they may end before the queries (all visible, or cut by the window) or start after
    some of them (those rows see nothing here). Row ``q0 + i`` sits at key position
    ``pos0 + i``; it sees key ``j`` iff ``k0 <= j < k1``, ``j <= pos`` and, under a window
    ``W``, ``j > pos - W``.
    """

    q0: int
    q1: int
    pos0: int
    k0: int
    k1: int


def piece_flash_calls(
    pieces: Sequence[Piece], window: int | None
) -> list[tuple[int, int, int, int, bool]] | None:
    """The pieces as flash-op calls ``(q0, q1, k0, k1, causal)``, or None when one cannot be.

    A piece's rows among its keys are a bottom-right causal block (the window, if any, as
    the op's ``(W - 1, 0)``); its rows after every key see them all, a block with no mask,
    except under a window (their window is not aligned to the block's diagonal). The split
    is :func:`piece_blocks`'s.
    """
    calls = []
    for q0, q1, pos0, k0, k1 in pieces:
        lo, hi = max(pos0, k0), pos0 + (q1 - q0)
        if window is not None:
            hi = min(hi, k1 + window - 1)
        if lo >= hi or k0 >= k1:
            continue
        mid = min(hi, max(lo, k1))
        if lo < mid:
            calls.append((q0 + lo - pos0, q0 + mid - pos0, k0, mid, True))
        if mid < hi:
            if window is not None:
                return None
            calls.append((q0 + mid - pos0, q0 + hi - pos0, k0, k1, False))
    return calls


def piece_blocks(piece: Piece, window: int | None) -> list[list[_Block]]:
    """The block groups of one piece; rows that see no key of the piece get none."""
    q0, q1, pos0, k0, k1 = piece
    lo = max(pos0, k0)  # rows before the first key see nothing
    hi = pos0 + (q1 - q0)
    if window is not None:
        hi = min(hi, k1 + window - 1)  # rows whose window ends before the keys' start
    if lo >= hi or k0 >= k1:
        return []
    groups: list[list[_Block]] = []
    mid = min(hi, max(lo, k1))  # rows before mid sit among the keys, the rest after them
    if lo < mid:  # rows whose own position is among the keys: a causal segment
        seg = Segment(q0 + lo - pos0, q0 + mid - pos0, k0, mid)
        groups += _segment_blocks(seg, window)
    if mid >= hi:
        return groups
    # Rows after every key: each sees all of them its window reaches.
    return groups + _rows_seeing_to_end(q0 + mid - pos0, q0 + hi - pos0, mid, k0, k1, window)


def _rows_seeing_to_end(r0: int, r1: int, pos: int, k0: int, k1: int, window: int | None
                        ) -> list[list[_Block]]:
    """Block groups of rows ``[r0, r1)`` (row ``r0`` at key position ``pos``) that see every
    key of ``[k0, k1)`` except those before their window: rows after all the keys (a P2P
    ring's piece), or an image's tokens, which see to the image's end whatever their place.
    """
    if window is None:
        return [[_Block(r0, r1, k0, k1, pos, False)]]
    groups = []
    rows = min(window, _MAX_ROWS)
    for a in range(r0, r1, rows):
        b = min(a + rows, r1)
        p0 = pos + a - r0
        p1 = p0 + b - a
        full0 = max(k0, p1 - window)  # the last row's first key: every row sees [full0, k1)
        blocks = [_Block(a, b, full0, k1, p0, False)]
        edge0 = max(k0, p0 - window + 1)  # the first row's first key
        if edge0 < full0:  # the last row sees none of the edge, every other row some
            blocks.append(_Block(a, b - 1, edge0, full0, p0, True))
        groups.append(blocks)
    return groups


@float32_inside
def pieces_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Piece],
    features: AttentionFeatures | float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q`` over one key block: ``out [Lq, Hq, D]`` (float32), ``lse``.

    Rows no piece reaches get ``out = 0`` and ``lse = -inf`` (they merge as "no keys").
    Given ``out`` / ``lse`` (results over other keys), the block is merged into them in place.
    ``kernel`` ``torch_flash`` / ``cudnn`` / ``fa4``: the pieces run on that kernel's ops
    where they apply (:func:`op_kernel`).
    """
    feats = as_features(features)
    if out is None or lse is None:
        out = out_like(q, v, torch.float32, 0.0)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    op, calls = _flash_calls(q, v, pieces, feats, kernel)
    if op is not None and calls is not None:
        for r0, r1, k0, k1, causal in calls:  # a row may be in two pieces: merge
            o, lo = op.block_forward(q[r0:r1], k[k0:k1], v[k0:k1], causal, feats)
            m_o, m_l = _merge_f32(out[r0:r1].transpose(0, 1), lse[:, r0:r1],
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
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key block's share, given the rows' fully merged ``out`` and ``lse``.

    ``grads``: ``(dq, dk, dv)`` accumulators (e.g. float32) to add into instead of new ones.
    ``kernel`` as in :func:`pieces_forward` (the same calls, so the same split).
    """
    feats = as_features(features)
    if grads is None:
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    dq, dk, dv = grads
    op, calls = _flash_calls(q, v, pieces, feats, kernel)
    if op is not None and calls is not None:
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


def _flash_calls(
    q: torch.Tensor, v: torch.Tensor, pieces: Sequence[Piece], feats: AttentionFeatures,
    kernel: str,
) -> tuple[OpKernel | None, list[tuple[int, int, int, int, bool]] | None]:
    """The fused ops and their calls for these pieces under ``kernel``; None for the block
    paths."""
    op = op_kernel(kernel, q, feats, v)
    return (None, None) if op is None else (op, piece_flash_calls(pieces, feats.window))


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] as a view (the CPU kernel reads the strided layout)."""
    return x.transpose(0, 1).unsqueeze(0)


def _lhd(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1)


def _visible(
    pos: int, rows: int, k0: int, keys: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[rows, keys]`` bool: key ``k0 + j`` visible to the row at key position ``pos + i``."""
    qp = torch.arange(pos, pos + rows, device=device)[:, None]
    kp = torch.arange(k0, k0 + keys, device=device)[None, :]
    keep = kp <= qp
    if window is not None:
        keep &= kp > qp - window
    return keep


def _is_plain_causal(blk: _Block, feats: AttentionFeatures) -> bool:
    """A square block whose rows sit on its keys, within the window: the causal flag covers it."""
    rows = blk.q1 - blk.q0
    in_window = feats.window is None or feats.window >= rows
    return blk.pos == blk.k0 and rows == blk.k1 - blk.k0 and in_window


def _cpu_mask(blk: _Block, feats: AttentionFeatures, like: torch.Tensor) -> torch.Tensor:
    """Additive mask for the CPU op (it wants the query's dtype); only edge blocks need one."""
    keep = _visible(
        blk.pos, blk.q1 - blk.q0, blk.k0, blk.k1 - blk.k0, feats.window, like.device
    )
    return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~keep, float("-inf")
    )


def _use_matmul_path(q: torch.Tensor, feats: AttentionFeatures) -> bool:
    return q.is_cuda or feats.softcap is not None


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _tile_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    pos: int,
    k0: int,
    masked: bool,
    feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 scores ``[1, H, rows, keys]`` of one tile (masked: -inf) and ``tanh`` if capped."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * feats.scale
    t = None
    if feats.softcap is not None:
        t = torch.tanh(s / feats.softcap)
        s = t * feats.softcap
    if masked:
        keep = _visible(pos, s.shape[-2], k0, s.shape[-1], feats.window, s.device)
        s = s.masked_fill(~keep, float("-inf"))
    return s, t


class _ScoreTile(NamedTuple):
    keys: slice  # keys of the block
    k: torch.Tensor  # [1, H, keys, D], KV heads expanded to the query heads
    v: torch.Tensor
    scores: torch.Tensor  # float32 [1, H, rows, keys], masked entries -inf
    tanh: torch.Tensor | None  # tanh(x / cap) under softcapping, for its derivative


def _row_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: _Block, feats: AttentionFeatures
) -> Iterator[tuple[slice, Iterator[_ScoreTile]]]:
    """The block's scores ``_TILE x _TILE`` at a time (never T x T): each row tile's slice,
    with an iterator over its key tiles."""
    groups = q.shape[1] // k.shape[1]

    def key_tiles(i: int) -> Iterator[_ScoreTile]:
        qi = q[:, :, i : i + _TILE]
        for j in range(0, k.shape[2], _TILE):
            keys = slice(j, j + _TILE)
            kj = _expand_kv(k[:, :, keys], groups)
            vj = _expand_kv(v[:, :, keys], groups)
            s, t = _tile_scores(qi, kj, blk.pos + i, blk.k0 + j, blk.masked, feats)
            yield _ScoreTile(keys, kj, vj, s, t)

    for i in range(0, q.shape[2], _TILE):
        yield slice(i, i + _TILE), key_tiles(i)


def _block_fwd_generic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: _Block, feats: AttentionFeatures
) -> tuple[torch.Tensor, torch.Tensor]:
    """Matmul path for one block (``[1, H, L, D]`` tensors), tile by tile."""
    out = out_like(q, v, torch.float32)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows, tiles in _row_tiles(q, k, v, blk, feats):
        acc, acc_lse = None, None
        for tile in tiles:
            lj = torch.logsumexp(tile.scores, dim=-1)
            # A tile can hide a whole row (lj = -inf); such a row gets weight 0, not NaN.
            p = torch.exp(tile.scores - torch.where(lj.isinf(), 0.0, lj).unsqueeze(-1))
            oj = torch.matmul(p, tile.v.float())
            if acc is None:
                acc, acc_lse = oj, lj
            else:
                acc, acc_lse = _merge_f32(acc, acc_lse, oj, lj)
        out[:, :, rows] = acc
        lse[:, :, rows] = acc_lse
    return out.to(q.dtype), lse


def _block_bwd_generic(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blk: _Block,
    feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the row's merged ``out`` and ``lse`` (matmul path)."""
    groups = q.shape[1] // k.shape[1]
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # Per query head (KV heads expanded); v's head dim may differ from k's (MLA).
    dk = torch.zeros(*k.shape[:1], q.shape[1], *k.shape[2:], dtype=torch.float32, device=q.device)
    dv = torch.zeros(*v.shape[:1], q.shape[1], *v.shape[2:], dtype=torch.float32, device=q.device)
    for rows, tiles in _row_tiles(q, k, v, blk, feats):
        qi, doi = q[:, :, rows].float(), dout[:, :, rows].float()
        li, di = lse[:, :, rows].unsqueeze(-1), delta[:, :, rows]
        for tile in tiles:
            p = torch.exp(tile.scores - li)
            dv[:, :, tile.keys] += torch.matmul(p.transpose(-1, -2), doi)
            ds = p * (torch.matmul(doi, tile.v.float().transpose(-1, -2)) - di)
            if tile.tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                ds = ds * (1 - tile.tanh * tile.tanh)
            ds = ds * feats.scale
            dq[:, :, rows] += torch.matmul(ds, tile.k.float())
            dk[:, :, tile.keys] += torch.matmul(ds.transpose(-1, -2), qi)
    if groups > 1:
        b, h, n, _ = dk.shape
        dk = dk.view(b, h // groups, groups, n, dk.shape[-1]).sum(2)
        dv = dv.view(b, h // groups, groups, n, dv.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: _Block, feats: AttentionFeatures
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_matmul_path(q, feats):
        return _block_fwd_generic(q, k, v, blk, feats)
    if not blk.masked:
        return _cpu_fwd(q, k, v, False, feats.scale)
    if _is_plain_causal(blk, feats):
        return _cpu_fwd(q, k, v, True, feats.scale)
    return _cpu_fwd(q, k, v, False, feats.scale, attn_mask=_cpu_mask(blk, feats, q))


def _block_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blk: _Block,
    feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_matmul_path(q, feats):
        return _block_bwd_generic(dout, q, k, v, out, lse, blk, feats)
    if not blk.masked:
        return _cpu_bwd(dout, q, k, v, out, lse, False, feats.scale)
    if _is_plain_causal(blk, feats):
        return _cpu_bwd(dout, q, k, v, out, lse, True, feats.scale)
    mask = _cpu_mask(blk, feats, q)
    return _cpu_bwd(dout, q, k, v, out, lse, False, feats.scale, attn_mask=mask)


def _merge_f32(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets (float32)."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(lse.isinf(), 0.0, lse)  # rows no key reached so far stay at 0
    out = o1 * torch.exp(l1 - safe).unsqueeze(-1) + o2 * torch.exp(l2 - safe).unsqueeze(-1)
    return out, lse


def _sees_whole(seg: Segment, window: int | None) -> bool:
    """Whether every row of a bidirectional segment sees all its keys (one block with no
    mask, which the op's non-causal block call computes); under a window narrower than its
    keys it does not, and runs on the block paths."""
    return window is None or window >= seg.k_end - seg.k_start


def _bidirectional_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
    feats: AttentionFeatures, out: torch.Tensor, lse: torch.Tensor, op: OpKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of every bidirectional segment (an image's tokens), which the op's causal
    varlen call left out: one non-causal op block each, or the block paths under a window."""
    both = [seg for seg in segments if seg.bidirectional]
    if not both:
        return out, lse
    out, lse = out.clone(), lse.clone()  # never write into the op's own tensors
    for seg in both:
        rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
        if _sees_whole(seg, feats.window):
            o, lo = op.block_forward(q[rows], k[keys], v[keys], False, feats)
            out[rows], lse[:, rows] = o.to(out.dtype), lo.float()
        else:
            _forward_groups(q, k, v, _segment_blocks(seg, feats.window), feats, out, lse)
    return out, lse


def _whole_block(
    segments: Sequence[Segment], q: torch.Tensor, feats: AttentionFeatures
) -> slice | None:
    """The key slice when one unwindowed causal square covers every query row (fast path)."""
    if len(segments) != 1 or _use_matmul_path(q, feats):
        return None
    seg = segments[0]
    n = q.shape[0]
    if (seg.q_start != 0 or seg.q_end != n or seg.k_end - seg.k_start != n or seg.has_prefix
            or seg.bidirectional):
        return None
    if feats.window is not None and feats.window < n:
        return None
    return slice(seg.k_start, seg.k_end)


@float32_inside
def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one value-less key of logit ``sinks[h]`` to every row's softmax.

    out ``[L, H, D]``, lse ``[H, L]`` float32, sinks ``[H]`` -> the same shapes, renormalised.
    """
    new_lse = torch.logaddexp(lse, sinks.detach().float()[:, None])
    weight = torch.exp(lse - new_lse).transpose(0, 1).unsqueeze(-1)
    return (out.float() * weight).to(out.dtype), new_lse


@float32_inside
def sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """d loss / d sinks, from the renormalised ``out``/``lse``: ``-sum_t P(sink) (dout . out)``."""
    rowdot = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [H, L]
    p_sink = torch.exp(sinks.detach().float()[:, None] - lse)
    return (-(p_sink * rowdot).sum(-1)).to(sinks.dtype)


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
        out[r0:r1] = _lhd(o)
        lse[:, r0:r1] = lo
        return
    m_o, m_l = _merge_f32(out[r0:r1].transpose(0, 1), lse[:, r0:r1], o[0].float(), lo.float())
    out[r0:r1] = m_o.transpose(0, 1)
    lse[:, r0:r1] = m_l


def _forward_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Iterable[list[_Block]],
    feats: AttentionFeatures,
    out: torch.Tensor,
    lse: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """Write the merged result of every block group into its rows of ``out`` / ``lse``.

    A group's first block covers all its rows; later ones a prefix of them (see
    :func:`_segment_blocks`). Rows no group covers are left untouched. ``accumulate``:
    merge with what the rows already hold (groups may then share rows; out is float32).
    """
    for blocks in groups:
        r0, r1 = blocks[0].q0, blocks[0].q1
        qs = _bhld(q[r0:r1])
        if len(blocks) == 1:  # nothing to merge: keep the kernel's dtype, no fp32 copy
            blk = blocks[0]
            o, lo = _block_fwd(
                qs, _bhld(k[blk.k0 : blk.k1]), _bhld(v[blk.k0 : blk.k1]), blk, feats
            )
            _store(out, lse, r0, r1, o, lo[0], accumulate)
            continue
        acc, acc_lse = None, None
        for blk in blocks:
            o, lo = _block_fwd(
                qs[:, :, : blk.q1 - r0], _bhld(k[blk.k0 : blk.k1]),
                _bhld(v[blk.k0 : blk.k1]), blk, feats,
            )
            o, lo = o.float(), lo.float()
            if acc is None:
                acc, acc_lse = o, lo
            else:  # later blocks may cover a prefix of the rows (the edge)
                rows = slice(0, blk.q1 - r0)
                m_o, m_l = _merge_f32(acc[:, :, rows], acc_lse[:, :, rows], o, lo)
                acc[:, :, rows], acc_lse[:, :, rows] = m_o, m_l
        _store(out, lse, r0, r1, acc, acc_lse[0], accumulate)


@float32_inside
def doc_causal_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every segment's queries to its keys.

    q: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]`` / ``[Lk, Hkv, Dv]`` with ``Hq % Hkv == 0``
    (GQA: query head ``h`` uses KV head ``h // (Hq // Hkv)``). Segments must cover every
    query row exactly once and name every key the rows may see (sinks join last, so pass
    them only with the whole set).
    Returns ``out [Lq, Hq, Dv]`` and ``lse [Hq, Lq]`` (float32). ``kernel``: ``torch`` (the
    block paths below) or one of :data:`OP_KERNELS` (its fused ops wherever they apply, see
    :func:`op_kernel`; the block paths otherwise).
    """
    feats = as_features(features)
    op = op_kernel(kernel, q, feats, v)
    if op is not None:
        causal = [seg for seg in segments if not seg.bidirectional]
        out, lse = op.varlen_forward(q, k, v, causal, feats)
        out, lse = _merge_prefix_blocks(q, k, v, segments, feats, out, lse, op)
        out, lse = _bidirectional_rows(q, k, v, segments, feats, out, lse, op)
        return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
    whole = _whole_block(segments, q, feats)
    if whole is not None:
        # One causal block covers everything: hand back the kernel's own tensors instead of
        # copying them into preallocated ones (which would briefly hold both).
        o, lo = _cpu_fwd(_bhld(q), _bhld(k[whole]), _bhld(v[whole]), True, feats.scale)
        out, lse = _lhd(o), lo[0].float()
        return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
    out = out_like(q, v)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    groups = (g for seg in segments for g in _segment_blocks(seg, feats.window))
    _forward_groups(q, k, v, groups, feats, out, lse)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


def _merge_prefix_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
    feats: AttentionFeatures, out: torch.Tensor, lse: torch.Tensor, op: OpKernel,
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
        merged, lse[:, rows] = _merge_f32(out[rows].transpose(0, 1).float(), lse[:, rows],
                                          o.transpose(0, 1).float(), lo)
        out[rows] = merged.transpose(0, 1).to(out.dtype)
    return out, lse


def _backward_groups(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    groups: Iterable[list[_Block]],
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
            dq1, dk1, dv1 = _block_bwd(
                _bhld(dout[rows]), _bhld(q[rows]), _bhld(k[keys]), _bhld(v[keys]),
                _bhld(out[rows]), lse[:, rows].unsqueeze(0).contiguous(), blk, feats,
            )
            dq[rows] += _lhd(dq1)
            dk[keys] += _lhd(dk1)
            dv[keys] += _lhd(dv1)


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
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`doc_causal_forward`: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``.

    ``out``/``lse`` are what the forward returned (after sinks, if any). Keys no segment reads
    get a zero gradient; keys read by several segments accumulate. ``kernel`` as in forward.
    """
    feats = as_features(features)
    op = op_kernel(kernel, q, feats, v)
    if op is not None:
        causal = [seg for seg in segments if not seg.bidirectional]
        dq, dk, dv = op.varlen_backward(dout, q, k, v, out, lse, causal, feats)
        for seg in (seg for seg in segments if seg.bidirectional):
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
            dq[rows] = 0  # rows the op's causal call did not cover
            if _sees_whole(seg, feats.window):
                dq1, dk1, dv1 = op.block_backward(dout[rows], q[rows], k[keys], v[keys],
                                                  out[rows], lse[:, rows], False, feats)
                dq[rows] += dq1
                dk[keys] += dk1
                dv[keys] += dv1
            else:
                _backward_groups(dout, q, k, v, out, lse, _segment_blocks(seg, feats.window),
                                 feats, dq, dk, dv)
        for seg in (seg for seg in segments if seg.has_prefix):
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.p_start, seg.p_end)
            dq1, dk1, dv1 = op.block_backward(dout[rows], q[rows], k[keys], v[keys], out[rows],
                                              lse[:, rows], False, feats)
            dq[rows] += dq1
            dk[keys] += dk1
            dv[keys] += dv1
        return dq, dk, dv
    if _whole_block(segments, q, feats) == slice(0, k.shape[0]):
        # Every key is read by the one causal block: its gradients are the whole dk, dv.
        dq1, dk1, dv1 = _cpu_bwd(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out),
            lse.unsqueeze(0).contiguous(), True, feats.scale,
        )
        return _lhd(dq1), _lhd(dk1), _lhd(dv1)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    groups = (g for seg in segments for g in _segment_blocks(seg, feats.window))
    _backward_groups(dout, q, k, v, out, lse, groups, feats, dq, dk, dv)
    return dq, dk, dv


class _DocCausalAttention(torch.autograd.Function):
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
    kernel: str = "torch",
    prefixes: tuple[tuple[int, int, int], ...] = (),
    bidirectional: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """Differentiable document-causal attention over a full packed row.

    q: ``[T, Hq, D]``, k/v: ``[T, Hkv, D]``; documents are ``cu_seqlens[i]:cu_seqlens[i+1]``;
    ``sinks`` ``[Hq]`` (optional) gets a gradient too; ``kernel``: ``torch`` or an op kernel;
    ``prefixes``: the row's branch documents (`SPMeta.prefixes`); ``bidirectional``: its
    image runs whose tokens see each other both ways (`SPMeta.bidirectional`).
    """
    feats = as_features(features)
    segments = full_row_segments(cu_seqlens, prefixes, bidirectional)
    return _DocCausalAttention.apply(q, k, v, sinks, segments, feats, kernel)

"""The tiled matmul path: one block's attention from its scores, ``TILE x TILE`` at a time.

What every device computes exactly: float32 scores ``q k^T * scale`` (then
``softcap * tanh(s / softcap)`` when the layer caps them), masked by the block's geometry
(:class:`~.block_geometry.Block`), merged tile by tile through the log-sum-exp; the backward
recomputes each tile from the rows' merged ``out``/``lse``. Softcapping needs the scores
themselves, so softcapped layers (and CUDA tensors on the ``torch`` kernel) take this path;
``validate`` names and budgets it (``kernel_choice.TILE``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

# Query rows and keys per score tile (validate budgets them; tests shrink them here).
from longctx_cli.kernel_choice import TILE

from .block_geometry import Block
from .features import AttentionFeatures
from .lse_merge import merge_f32, out_like


def visible(
    pos: int, rows: int, k0: int, keys: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[rows, keys]`` bool: key ``k0 + j`` visible to the row at key position ``pos + i``."""
    qp = torch.arange(pos, pos + rows, device=device)[:, None]
    kp = torch.arange(k0, k0 + keys, device=device)[None, :]
    keep = kp <= qp
    if window is not None:
        keep &= kp > qp - window
    return keep


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
        keep = visible(pos, s.shape[-2], k0, s.shape[-1], feats.window, s.device)
        s = s.masked_fill(~keep, float("-inf"))
    return s, t


class _ScoreTile(NamedTuple):
    keys: slice  # keys of the block
    k: torch.Tensor  # [1, H, keys, D], KV heads expanded to the query heads
    v: torch.Tensor
    scores: torch.Tensor  # float32 [1, H, rows, keys], masked entries -inf
    tanh: torch.Tensor | None  # tanh(x / cap) under softcapping, for its derivative


def _row_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: Block, feats: AttentionFeatures
) -> Iterator[tuple[slice, Iterator[_ScoreTile]]]:
    """The block's scores ``TILE x TILE`` at a time (never T x T): each row tile's slice,
    with an iterator over its key tiles."""
    groups = q.shape[1] // k.shape[1]

    def key_tiles(i: int) -> Iterator[_ScoreTile]:
        qi = q[:, :, i : i + TILE]
        for j in range(0, k.shape[2], TILE):
            keys = slice(j, j + TILE)
            kj = _expand_kv(k[:, :, keys], groups)
            vj = _expand_kv(v[:, :, keys], groups)
            s, t = _tile_scores(qi, kj, blk.pos + i, blk.k0 + j, blk.masked, feats)
            yield _ScoreTile(keys, kj, vj, s, t)

    for i in range(0, q.shape[2], TILE):
        yield slice(i, i + TILE), key_tiles(i)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: Block, feats: AttentionFeatures
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (``[1, H, L, D]`` tensors), tile by tile: ``out`` in q's dtype, ``lse``
    ``[1, H, L]`` float32."""
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
                acc, acc_lse = merge_f32(acc, acc_lse, oj, lj)
        out[:, :, rows] = acc
        lse[:, :, rows] = acc_lse
    return out.to(q.dtype), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blk: Block,
    feats: AttentionFeatures,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the row's merged ``out`` and ``lse``."""
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

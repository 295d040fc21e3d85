"""Local document-causal attention with log-sum-exp, in pure PyTorch.

This is the part of SP attention that has nothing to do with communication: given local
queries and a key/value tensor, attend each query block to the keys it may see inside its
own document. Strategies (ring, Ulysses) reduce their work to calls of these functions.

Work is split into *segments*: a run of consecutive query rows of one document. A segment
with queries ``q[q_start:q_end]`` whose last key is ``k_end`` attends to ``k[k_start:k_end]``
with bottom-right causal alignment (query ``q_end - 1`` sees key ``k_end - 1``). Each segment
is computed as two blocks so that no mask tensor is ever built:

* the *prefix* ``k[k_start : k_end - n]`` (``n`` = number of queries), fully visible;
* the *diagonal* ``k[k_end - n : k_end]``, a square causal block.

The two partial results are merged exactly through their log-sum-exp. The backward of each
block is computed with the merged output and log-sum-exp, which gives exact gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Segment(NamedTuple):
    """Queries ``q[q_start:q_end]`` attend to keys ``k[k_start:k_end]`` (bottom-right causal)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int


def full_row_segments(cu_seqlens: Sequence[int] | torch.Tensor) -> tuple[Segment, ...]:
    """Segments for a full row where queries and keys are the same tokens (one per document)."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return tuple(Segment(a, b, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] as a view (the CPU kernel reads the strided layout)."""
    return x.transpose(0, 1).unsqueeze(0)


def _lhd(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1)


def _block_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        return _block_fwd_generic(q, k, v, causal, scale)
    out, lse = _FWD(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _block_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        return _block_bwd_generic(dout, q, k, v, out, lse, causal, scale)
    return _BWD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _block_fwd_generic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference math for devices without the CPU flash op (block-sized, never T x T)."""
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, _expand_kv(k, groups), causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, _expand_kv(v, groups).float()).to(q.dtype)
    return out, lse


def _block_bwd_generic(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups).float(), _expand_kv(v, groups).float()
    p = torch.exp(_scores(q, ke, causal, scale) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, ve.transpose(-1, -2))
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, ke)
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    if groups > 1:
        b, h, n, d = dk.shape
        dk = dk.view(b, h // groups, groups, n, d).sum(2)
        dv = dv.view(b, h // groups, groups, n, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets."""
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).unsqueeze(-1)
    out = o1.float() * w1 + o2.float() * w2
    return out.to(o1.dtype), lse


def _whole_block(segments: Sequence[Segment], q: torch.Tensor, k: torch.Tensor) -> slice | None:
    """The key slice when one segment is a plain causal square over every query row."""
    if len(segments) != 1:
        return None
    seg = segments[0]
    n = q.shape[0]
    if seg.q_start != 0 or seg.q_end != n or seg.k_end - seg.k_start != n:
        return None
    return slice(seg.k_start, seg.k_end)


def doc_causal_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every segment's queries to its keys.

    q: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head ``h``
    uses KV head ``h // (Hq // Hkv)``). Segments must cover every query row exactly once.
    Returns ``out [Lq, Hq, D]`` and ``lse [Hq, Lq]`` (float32).
    """
    whole = _whole_block(segments, q, k)
    if whole is not None:
        # One causal block covers everything: hand back the kernel's own tensors instead of
        # copying them into preallocated ones (which would briefly hold both).
        o, lo = _block_fwd(_bhld(q), _bhld(k[whole]), _bhld(v[whole]), True, scale)
        return _lhd(o), lo[0].float()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for seg in segments:
        n = seg.q_end - seg.q_start
        if n == 0:
            continue
        qs = _bhld(q[seg.q_start : seg.q_end])
        diag = seg.k_end - n
        o, lo = _block_fwd(qs, _bhld(k[diag : seg.k_end]), _bhld(v[diag : seg.k_end]), True, scale)
        if diag > seg.k_start:
            o2, l2 = _block_fwd(
                qs, _bhld(k[seg.k_start : diag]), _bhld(v[seg.k_start : diag]), False, scale
            )
            o, lo = _merge(o, lo.float(), o2, l2.float())
        out[seg.q_start : seg.q_end] = _lhd(o)
        lse[:, seg.q_start : seg.q_end] = lo[0]
    return out, lse


def doc_causal_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: Sequence[Segment],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`doc_causal_forward`: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``.

    Keys no segment reads get a zero gradient; keys read by several segments accumulate.
    """
    if _whole_block(segments, q, k) == slice(0, k.shape[0]):
        # Every key is read by the one causal block: its gradients are the whole dk, dv.
        dq1, dk1, dv1 = _block_bwd(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out),
            lse.unsqueeze(0).contiguous(), True, scale,
        )
        return _lhd(dq1), _lhd(dk1), _lhd(dv1)
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for seg in segments:
        n = seg.q_end - seg.q_start
        if n == 0:
            continue
        rows = slice(seg.q_start, seg.q_end)
        qs, dos, os_ = _bhld(q[rows]), _bhld(dout[rows]), _bhld(out[rows])
        ls = lse[:, rows].unsqueeze(0).contiguous()
        diag = seg.k_end - n
        dq1, dk1, dv1 = _block_bwd(
            dos, qs, _bhld(k[diag : seg.k_end]), _bhld(v[diag : seg.k_end]), os_, ls, True, scale
        )
        dk[diag : seg.k_end] += _lhd(dk1)
        dv[diag : seg.k_end] += _lhd(dv1)
        if diag > seg.k_start:
            keys = slice(seg.k_start, diag)
            dq2, dk2, dv2 = _block_bwd(
                dos, qs, _bhld(k[keys]), _bhld(v[keys]), os_, ls, False, scale
            )
            dq1 = dq1 + dq2
            dk[keys] += _lhd(dk2)
            dv[keys] += _lhd(dv2)
        dq[rows] = _lhd(dq1)
    return dq, dk, dv


class _DocCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, scale):  # type: ignore[override]
        out, lse = doc_causal_forward(q, k, v, segments, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments = segments
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = doc_causal_backward(
            dout.contiguous(), q, k, v, out, lse, ctx.segments, ctx.scale
        )
        return dq, dk, dv, None, None


def doc_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Differentiable document-causal attention over a full packed row.

    q: ``[T, Hq, D]``, k/v: ``[T, Hkv, D]``; documents are ``cu_seqlens[i]:cu_seqlens[i+1]``.
    """
    return _DocCausalAttention.apply(q, k, v, full_row_segments(cu_seqlens), scale)

"""Llama3-style ring attention in PyTorch, on the state's resolved kernel (the ``flash``
kernel runs ring-flash-attn's own ring, and this one only for rows that ring cannot take).

Forward, for each group of ``heads_k_stride`` KV heads: all-gather this group's K,V over the
SP group (the next group's gather runs while the current one is computed), put the chunks
in global token order (zigzag), and let every local query segment attend to the keys of its
document (:mod:`.torch_kernel`, on the state's resolved kernel). Only local tensors are saved
for backward.

Backward re-gathers K,V per head group, computes dq locally and dK,dV for the whole row,
then reduce-scatters dK,dV back to their owners. Gathered rows are put in order in place
(:func:`.sharding.to_global_order_`), and each group's gathered K,V and whole-row dK,dV are
freed before the next group's; when the caller hands q, k, v over spent
(:func:`.features.writable_inputs`), dq, dk, dv are written over them, a group's heads after
they were last read. The peak of the layer's backward then holds no second copy of the
local q, k, v beside their gradients.
"""

from __future__ import annotations

import torch

from .features import AttentionFeatures, as_features, writable_inputs
from .lse_merge import out_like, sink_grad
from .sharding import (
    SPMeta,
    all_gather_tensor,
    reduce_scatter_sum,
    to_global_order_,
    to_rank_order_,
)
from .torch_kernel import doc_causal_backward, doc_causal_forward


class _Gather:
    """An in-flight all-gather of one head group's K and V."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, meta: SPMeta):
        self.meta = meta
        group, n = meta.ctx.sp_group, meta.ctx.layout.sp
        if n == 1:
            self.k, self.v, self.handles = k, v, []
            return
        self.k = k.new_empty((k.shape[0] * n, *k.shape[1:]))
        self.v = v.new_empty((v.shape[0] * n, *v.shape[1:]))
        self.handles = [
            all_gather_tensor(self.k, k.contiguous(), group=group, async_op=True),
            all_gather_tensor(self.v, v.contiguous(), group=group, async_op=True),
        ]

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for h in self.handles:
            h.wait()
        # The buffers are this gather's own: put in global order where they lie.
        return to_global_order_(self.k, self.meta), to_global_order_(self.v, self.meta)


def _reduce_scatter_into(dest: torch.Tensor, full: torch.Tensor, meta: SPMeta) -> None:
    """Sum ``full`` (whole-row, global order; rearranged in place) over the SP group into
    this rank's ``dest``."""
    if meta.ctx.layout.sp == 1:
        dest.copy_(full)
        return
    src = to_rank_order_(full, meta).contiguous()  # a copy only if the kernel's is strided
    if dest.is_contiguous():  # straight into the gradient (one KV head of a heads-major k)
        reduce_scatter_sum(dest, src, group=meta.ctx.sp_group)
        return
    out = src.new_empty(dest.shape)
    reduce_scatter_sum(out, src, group=meta.ctx.sp_group)
    dest.copy_(out)


def _head_groups(q: torch.Tensor, k: torch.Tensor, stride: int) -> list[tuple[slice, slice]]:
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk != 0:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hk}")
    if stride < 1 or hk % stride != 0:
        raise ValueError(f"heads_k_stride {stride} must divide the {hk} key/value heads")
    g = hq // hk
    return [(slice(i * g, (i + stride) * g), slice(i, i + stride)) for i in range(0, hk, stride)]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, meta, feats):  # type: ignore[override]
        # The stride bounds the gathered K,V; with nothing to gather (sp 1) one call takes
        # every head: a kernel call per KV head only cut the GPU's work into small launches.
        layout = meta.ctx.layout
        groups = _head_groups(q, k, k.shape[1] if layout.sp == 1 else layout.heads_k_stride)
        out = out_like(q, v)  # v's head dim (multi-head latent attention: not q's)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        pending = _Gather(k[:, groups[0][1]], v[:, groups[0][1]], meta)
        for i, (qh, _) in enumerate(groups):
            kf, vf = pending.wait()
            if i + 1 < len(groups):  # overlap the next gather with this group's compute
                nxt = groups[i + 1][1]
                pending = _Gather(k[:, nxt], v[:, nxt], meta)
            # Each local query sees every key it may attend to here, so sinks join now.
            o, lo = doc_causal_forward(
                q[:, qh], kf, vf, meta.segments, feats, None if sinks is None else sinks[qh],
                kernel=meta.ctx.kernel,
            )
            out[:, qh] = o
            lse[qh] = lo
            del kf, vf, o, lo  # this group's gathered K,V go before the next group's land
        # Local tensors only: full-length K,V are re-gathered in backward.
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.meta, ctx.feats, ctx.groups = meta, feats, groups
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        meta, groups = ctx.meta, ctx.groups
        dout = dout.contiguous()
        if writable_inputs(ctx.feats, q, k, v):
            # Spent: a group's q, k, v heads are read (k, v gathered: the next group's gather
            # reads other heads) before its gradients are written over them.
            dq, dk, dv = q.detach(), k.detach(), v.detach()
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pending = _Gather(k[:, groups[0][1]], v[:, groups[0][1]], meta)
        for i, (qh, kh) in enumerate(groups):
            kf, vf = pending.wait()
            if i + 1 < len(groups):
                nxt = groups[i + 1][1]
                pending = _Gather(k[:, nxt], v[:, nxt], meta)
            dqi, dkf, dvf = doc_causal_backward(
                dout[:, qh], q[:, qh], kf, vf, out[:, qh], lse[qh], meta.segments, ctx.feats,
                kernel=meta.ctx.kernel,
            )
            del kf, vf  # read no more: freed before the reduce-scatter's buffers
            dq[:, qh] = dqi
            del dqi
            _reduce_scatter_into(dk[:, kh], dkf, meta)
            del dkf
            _reduce_scatter_into(dv[:, kh], dvf, meta)
            del dvf  # the next group starts with none of this one's whole-row tensors
        # This rank's tokens' share; the trainer sums parameter gradients over ranks.
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    features: AttentionFeatures | float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact document-causal attention of local ``q`` over the whole row's K,V.

    ``sinks`` (``[Hq]``, optional) is differentiable like q, k, v.
    """
    return RingAttention.apply(q, k, v, sinks, meta, as_features(features))

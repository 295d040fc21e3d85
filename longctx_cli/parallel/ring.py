"""Llama3-style ring attention in PyTorch, on the state's resolved kernel (the ``flash``
kernel runs ring-flash-attn's own ring, and this one only for rows that ring cannot take).

Forward, for each group of ``heads_k_stride`` KV heads: all-gather this group's K,V over the
SP group (the next group's gather runs while the current one is computed), put the chunks
in global token order (zigzag), and let every local query segment attend to the keys of its
document (:mod:`.torch_kernel`, on the state's resolved kernel). Only local tensors are saved
for backward.

Backward re-gathers K,V per head group, computes dq locally and dK,dV for the whole row,
then reduce-scatters dK,dV back to their owners.
"""

from __future__ import annotations

import torch

from .features import AttentionFeatures, as_features
from .lse_merge import out_like, sink_grad
from .sharding import (
    SPMeta,
    all_gather_tensor,
    reduce_scatter_sum,
    to_global_order,
    to_rank_order,
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
        return to_global_order(self.k, self.meta), to_global_order(self.v, self.meta)


def _reduce_scatter(full: torch.Tensor, meta: SPMeta) -> torch.Tensor:
    if meta.ctx.layout.sp == 1:
        return full
    src = to_rank_order(full, meta).contiguous()
    out = src.new_empty((src.shape[0] // meta.ctx.layout.sp, *src.shape[1:]))
    reduce_scatter_sum(out, src, group=meta.ctx.sp_group)
    return out


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
        # Local tensors only: full-length K,V are re-gathered in backward.
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.meta, ctx.feats, ctx.groups = meta, feats, groups
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        meta, groups = ctx.meta, ctx.groups
        dout = dout.contiguous()
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
            dq[:, qh] = dqi
            dk[:, kh] = _reduce_scatter(dkf, meta)
            dv[:, kh] = _reduce_scatter(dvf, meta)
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

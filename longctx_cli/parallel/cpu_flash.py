"""One block of the block paths: on PyTorch's CPU flash op, or the tiled path where it cannot.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) returns the
log-sum-exp and takes a causal flag aligned top-left, which a square block whose rows sit on
its keys needs; any other masked block (a window's edge) passes the one additive ``b x b``
mask it needs. Blocks are ``[1, H, L, D]`` (:func:`bhld` views the ``[L, H, D]`` rows).

Values may have their own head dim (multi-head latent attention): outputs take v's. The CPU
op takes one head dim, so its calls pad the smaller side with zeros (exact). Softcapped
layers and CUDA tensors take :mod:`.tiled` instead (:func:`use_tiled_path`).
"""

from __future__ import annotations

import torch

from .block_geometry import Block, is_plain_causal
from .features import AttentionFeatures
from .tiled import block_backward as tiled_backward
from .tiled import block_forward as tiled_forward
from .tiled import visible
from .torch_flash import pad_head_dim

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def cpu_forward(
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


def cpu_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`cpu_forward` (padded the same way; the padded columns' gradients
    are dropped, and zero ``dout`` columns leave the rest exact)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return _BWD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)
    d = max(dqk, dv)
    gq, gk, gv = _BWD(*(pad_head_dim(t, d) for t in (dout, q, k, v, out)), lse, 0.0, causal,
                      attn_mask=attn_mask, scale=scale)
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]


def bhld(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] as a view (the CPU kernel reads the strided layout)."""
    return x.transpose(0, 1).unsqueeze(0)


def lhd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, L, D] -> [L, H, D] as a view."""
    return x.squeeze(0).transpose(0, 1)


def use_tiled_path(q: torch.Tensor, feats: AttentionFeatures) -> bool:
    """The tiled path where the CPU op cannot: CUDA tensors, or scores to softcap."""
    return q.is_cuda or feats.softcap is not None


def _mask(blk: Block, feats: AttentionFeatures, like: torch.Tensor) -> torch.Tensor:
    """Additive mask for the CPU op (it wants the query's dtype); only edge blocks need one."""
    keep = visible(
        blk.pos, blk.q1 - blk.q0, blk.k0, blk.k1 - blk.k0, feats.window, like.device
    )
    return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~keep, float("-inf")
    )


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: Block, feats: AttentionFeatures
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (``[1, H, L, D]``): ``out`` and ``lse`` ``[1, H, L]`` float32."""
    if use_tiled_path(q, feats):
        return tiled_forward(q, k, v, blk, feats)
    if not blk.masked:
        return cpu_forward(q, k, v, False, feats.scale)
    if is_plain_causal(blk, feats.window):
        return cpu_forward(q, k, v, True, feats.scale)
    return cpu_forward(q, k, v, False, feats.scale, attn_mask=_mask(blk, feats, q))


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
    """Gradients of :func:`block_forward`'s block given the rows' merged ``out``/``lse``."""
    if use_tiled_path(q, feats):
        return tiled_backward(dout, q, k, v, out, lse, blk, feats)
    if not blk.masked:
        return cpu_backward(dout, q, k, v, out, lse, False, feats.scale)
    if is_plain_causal(blk, feats.window):
        return cpu_backward(dout, q, k, v, out, lse, True, feats.scale)
    mask = _mask(blk, feats, q)
    return cpu_backward(dout, q, k, v, out, lse, False, feats.scale, attn_mask=mask)

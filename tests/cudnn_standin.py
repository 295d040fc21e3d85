"""Test-only CPU stand-ins of PyTorch's cuDNN attention ops (the ``cudnn`` kernel's four ops).

Signatures are torch 2.13's own (``torch.ops.aten.<op>.default._schema``):

* ``_scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
  dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None)`` -> ``(output,
  logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
  debug_attn_mask)``;
* ``_scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp,
  philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
  is_causal, *, scale=None)`` -> ``(dq, dk, dv)``;
* ``_cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q,
  max_k, compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False, *,
  scale=None)`` -> the same 9-tuple;
* ``_cudnn_attention_backward(...)``: the dense backward's signature.

Semantics, as read in PyTorch's source (``aten/src/ATen/native/cudnn/MHA.cpp``,
``aten/src/ATen/native/transformers/cuda/attention_backward.cu``,
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``):

* dense tensors ``[B, H, S, D]`` (any strides, unit last one), GQA by fewer KV heads
  (query head ``h`` reads KV head ``h // (Hq / Hkv)``); the log-sum-exp is ``[B, H, S_q, 1]``
  float32 in natural-log units; the dense backward takes its sequence lengths from
  ``max_q``/``max_k`` (asserted equal to the tensors'), ``attn_bias`` and ``cum_seq_*``
  undefined (``None``);
* ragged tensors ``[total, H, D]`` with int32 ``cum_seq_q/k`` (``cum_seq_q.defined()`` picks
  the ragged branch); the log-sum-exp ``[H, total_q]`` (recent PyTorch) or ``[total_q, H, 1]``
  (older), chosen here by :data:`LSE_LAYOUT`; its backward must get it back in that layout;
* causal is **top-left** aligned (``set_causal_mask``: query ``i`` sees keys ``j <= i`` of its
  sequence), unlike the flash op's bottom-right;
* SDPA's cuDNN gate refuses a key length of 1, and ``MHA.cpp``'s ``check_cudnn_sdpa_decode``
  one query row on some cuDNN builds for Blackwell; the kernel must never send either
  (asserted);
* the backward takes ``out``/``logsumexp`` as given (merged ones, in our use): ``P = exp(S -
  lse)``, ``dS = P * (dO V^T - rowsum(dO * out))``.

Math is float64, outputs in the input dtype. ``CALLS`` counts calls per op.
"""

from __future__ import annotations

import torch

from longctx_cli.parallel.cudnn_attention import CudnnOps

CALLS = {"dense_forward": 0, "dense_backward": 0, "ragged_forward": 0, "ragged_backward": 0}
LSE_LAYOUT = {"ragged": "HT"}  # or "TH1" (older PyTorch)


def _check(query, key, value, dropout_p, attn_bias) -> None:
    assert dropout_p == 0.0 and attn_bias is None
    assert query.dtype == key.dtype == value.dtype
    assert query.shape[-1] == key.shape[-1] and key.shape[:-1] == value.shape[:-1]
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256 and value.shape[-1] <= 256
    for t in (query, key, value):
        assert t.stride(-1) == 1, "the ops read rows with a unit last stride"


def _attend(q, k, v, scale, causal):
    """One sequence, ``q [Lq, Hq, D]``: float64 ``out [Lq, Hq, Dv]`` and ``lse [Hq, Lq]``."""
    groups = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(groups, 1)
    vv = v.double().repeat_interleave(groups, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:  # top-left
        keep = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return out, lse


def _grads(do, q, k, v, o, lse, scale, causal):
    """One sequence's dq, dk, dv (float64) from the given out / lse ``[Hq, Lq]``."""
    hq, hk = q.shape[1], k.shape[1]
    groups = hq // hk
    kk = k.double().repeat_interleave(groups, 1)
    vv = v.double().repeat_interleave(groups, 1)
    qd, dod, od = q.double(), do.double(), o.double()
    s = torch.einsum("qhd,khd->hqk", qd, kk) * scale
    if causal:
        keep = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s - lse.double()[..., None])
    dv = torch.einsum("hqk,qhd->khd", p, dod)
    delta = (dod * od).sum(-1).transpose(0, 1)[..., None]
    ds = p * (torch.einsum("qhd,khd->hqk", dod, vv) - delta) * scale
    dq = torch.einsum("hqk,khd->qhd", ds, kk)
    dk = torch.einsum("hqk,qhd->khd", ds, qd)
    n = k.shape[0]
    return dq, dk.view(n, hk, groups, -1).sum(2), dv.view(n, hk, groups, -1).sum(2)


def _empty(dtype):
    return torch.empty(0, dtype=dtype)


def dense_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                  is_causal=False, return_debug_mask=False, *, scale=None):
    _check(query, key, value, dropout_p, attn_bias)
    assert query.dim() == 4 and compute_log_sumexp and not return_debug_mask
    assert key.shape[2] > 1, "SDPA's cuDNN gate refuses key length 1"
    assert query.shape[2] > 1, "one query row: the decode shape some cuDNN builds refuse"
    CALLS["dense_forward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    b, h, sq, _ = query.shape
    out = torch.empty(b, h, sq, value.shape[-1], dtype=query.dtype)
    lse = torch.empty(b, h, sq, 1, dtype=torch.float32)
    for i in range(b):
        o, lo = _attend(query[i].transpose(0, 1), key[i].transpose(0, 1),
                        value[i].transpose(0, 1), scale, is_causal)
        out[i] = o.transpose(0, 1).to(query.dtype)
        lse[i, :, :, 0] = lo.float()
    seed = torch.zeros((), dtype=torch.int64)
    return (out, lse, None, None, sq, key.shape[2], seed, seed.clone(),
            _empty(query.dtype))


def dense_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                   attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                   scale=None):
    _check(query, key, value, dropout_p, attn_bias)
    assert cum_seq_q is None and cum_seq_k is None, "undefined: the dense branch"
    assert (max_q, max_k) == (query.shape[2], key.shape[2]), "the op reads lengths from these"
    assert grad_out.shape == out.shape and out.dtype == query.dtype
    assert logsumexp.dtype == torch.float32
    assert tuple(logsumexp.shape) == (*query.shape[:3], 1), "lse is [B, H, S_q, 1]"
    CALLS["dense_backward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
    for i in range(query.shape[0]):
        g = _grads(*(t[i].transpose(0, 1) for t in (grad_out, query, key, value, out)),
                   logsumexp[i, :, :, 0], scale, is_causal)
        for dst, src in zip((dq, dk, dv), g, strict=True):
            dst[i] = src.transpose(0, 1).to(dst.dtype)
    return dq, dk, dv


def _sequences(cum_seq_q, cum_seq_k, total_q, total_k, max_q, max_k):
    for cu, total, longest in ((cum_seq_q, total_q, max_q), (cum_seq_k, total_k, max_k)):
        assert cu is not None and cu.dtype == torch.int32 and cu.dim() == 1
        bounds = cu.tolist()
        assert bounds[0] == 0 and bounds[-1] == total, (bounds, total)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert min(lengths) > 0 and max(lengths) <= longest, (lengths, longest)
    assert cum_seq_q.numel() == cum_seq_k.numel()
    bq, bk = cum_seq_q.tolist(), cum_seq_k.tolist()
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


def ragged_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                   compute_log_sumexp, dropout_p=0.0, is_causal=False,
                   return_debug_mask=False, *, scale=None):
    _check(query, key, value, dropout_p, attn_bias)
    assert query.dim() == 3 and compute_log_sumexp and not return_debug_mask
    assert max_q > 1, "one query row: the decode shape some cuDNN builds refuse"
    CALLS["ragged_forward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(*query.shape[:2], value.shape[-1], dtype=query.dtype)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32)
    for qa, qb, ka, kb in _sequences(cum_seq_q, cum_seq_k, query.shape[0], key.shape[0],
                                     max_q, max_k):
        o, lo = _attend(query[qa:qb], key[ka:kb], value[ka:kb], scale, is_causal)
        out[qa:qb], lse[:, qa:qb] = o.to(query.dtype), lo.float()
    if LSE_LAYOUT["ragged"] == "TH1":
        lse = lse.transpose(0, 1).unsqueeze(-1).contiguous()
    seed = torch.zeros((), dtype=torch.int64)
    return (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, seed.clone(),
            _empty(query.dtype))


def ragged_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                    attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                    scale=None):
    _check(query, key, value, dropout_p, attn_bias)
    assert grad_out.shape == out.shape and out.dtype == query.dtype
    assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    t, h = query.shape[:2]
    if LSE_LAYOUT["ragged"] == "TH1":
        assert tuple(logsumexp.shape) == (t, h, 1), "older PyTorch: lse is [T, H, 1]"
        logsumexp = logsumexp[..., 0].transpose(0, 1)
    else:
        assert tuple(logsumexp.shape) == (h, t), "lse is [H, T]"
    CALLS["ragged_backward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (query, key, value))
    for qa, qb, ka, kb in _sequences(cum_seq_q, cum_seq_k, t, key.shape[0], max_q, max_k):
        g = _grads(grad_out[qa:qb], query[qa:qb], key[ka:kb], value[ka:kb], out[qa:qb],
                   logsumexp[:, qa:qb], scale, is_causal)
        dq[qa:qb] += g[0]
        dk[ka:kb] += g[1]
        dv[ka:kb] += g[2]
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


OPS = CudnnOps(
    dense_forward=dense_forward,
    dense_backward=dense_backward,
    ragged_forward=ragged_forward,
    ragged_backward=ragged_backward,
    supports=lambda q: q.shape[-1] % 8 == 0 and q.shape[-1] <= 256,  # any device and dtype
    name="tests.cudnn_standin",
)

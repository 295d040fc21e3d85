"""flash-attn 2.7 kernel entry points (varlen and batched), as dense per-sequence math.

Conventions kept from flash-attn: tensors are ``[tokens, heads, dim]`` (varlen) or
``[batch, seqlen, heads, dim]``; GQA maps query head ``h`` to KV head ``h // (Hq // Hk)``;
``causal`` with ``seqlen_q != seqlen_k`` is aligned to the bottom right; ``window_size``
``(left, right)`` lets query ``i`` (at key position ``i'`` under that alignment) see keys
``i' - left .. i' + right`` (-1: unbounded); ``softcap > 0`` maps scaled scores to
``softcap * tanh(s / softcap)``; the varlen log-sum-exp is ``[heads, total_q]`` float32;
backward takes the probabilities from the ``softmax_lse`` it is given (as flash-attn does,
which is what ring functions rely on) and writes ``dq, dk, dv`` in place.
"""

from __future__ import annotations

import torch


def _dense(q, k, v, scale: float, causal: bool, window=(-1, -1), softcap: float = 0.0,
           dropout_p: float = 0.0):
    """One sequence: q ``[Lq, Hq, D]``, k/v ``[Lk, Hk, D]`` -> (out, lse ``[Hq, Lq]``).
    ``dropout_p``: the probabilities are dropped with a mask drawn from the default generator
    (flash-attn draws the same law from its philox state)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    lq, lk = q.shape[0], k.shape[0]
    at = torch.arange(lq)[:, None] + (lk - lq)  # each query's key position, bottom-right
    j = torch.arange(lk)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= at
    if window[0] >= 0:
        allowed &= j >= at - window[0]
    if window[1] >= 0:
        allowed &= j <= at + window[1]
    if not allowed.all():
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if dropout_p:
        probs = probs * torch.empty_like(probs).bernoulli_(1 - dropout_p) / (1 - dropout_p)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype), lse


def _dense_backward(dout, q, k, v, out, lse, scale, causal, window, softcap):
    """flash-attn's backward of one sequence: probabilities from the given ``lse``
    ``[Hq, Lq]`` and ``delta = rowsum(dout * out)``, so that a block of a ring (whose
    ``lse`` / ``out`` cover more keys than the block) gets its exact share."""
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1).float()
    vv = v.repeat_interleave(groups, dim=1).float()
    qf, do = q.float(), dout.float()
    scores = torch.einsum("qhd,khd->hqk", qf, kk) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(scores / softcap)
        scores = softcap * t
    lq, lk = q.shape[0], k.shape[0]
    at = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= at
    if window[0] >= 0:
        allowed &= j >= at - window[0]
    if window[1] >= 0:
        allowed &= j <= at + window[1]
    p = torch.exp(scores - lse.float()[..., None]).masked_fill(~allowed, 0.0)
    delta = (do * out.float()).sum(-1).transpose(0, 1)  # [Hq, Lq]
    ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, qf) * scale
    dv = torch.einsum("hqk,qhd->khd", p, do)
    hk, d = k.shape[1], k.shape[2]
    dk = dk.view(lk, hk, groups, d).sum(2)
    dv = dv.view(lk, hk, groups, v.shape[2]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check_head_dims(q, k, v) -> None:
    """flash-attn 2 takes one head dim for q, k and v (its kernels check the shapes)."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2: q, k, v head dims differ"


def _pairs(cu_q, cu_k):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
):
    assert dropout_p == 0 and alibi_slopes is None
    _check_head_dims(q, k, v)
    window = (window_size_left, window_size_right)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for qa, qb, ka, kb in _pairs(cu_seqlens_q, cu_seqlens_k):
        if qb > qa:
            o, lo = _dense(q[qa:qb], k[ka:kb], v[ka:kb], softmax_scale, causal, window, softcap)
            out[qa:qb], lse[:, qa:qb] = o, lo
    return out, lse, None, torch.zeros(2, dtype=torch.int64)


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    rng_state=None,
    zero_tensors=False,
):
    assert dropout_p == 0 and alibi_slopes is None
    _check_head_dims(q, k, v)
    window = (window_size_left, window_size_right)
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qa, qb, ka, kb in _pairs(cu_seqlens_q, cu_seqlens_k):
        if qb == qa:
            continue
        grads = _dense_backward(
            dout[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], softmax_lse[:, qa:qb],
            softmax_scale, causal, window, softcap,
        )
        gq[qa:qb] += grads[0]
        gk[ka:kb] += grads[1]
        gv[ka:kb] += grads[2]
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()


def _flatten(x):
    return x.reshape(-1, *x.shape[2:])


def _batch_cu(batch: int, seqlen: int):
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
):
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    out, lse, _, rng = _flash_attn_varlen_forward(
        _flatten(q), _flatten(k), _flatten(v), _batch_cu(b, sq), _batch_cu(b, sk), sq, sk,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
        alibi_slopes,
    )
    lse = lse.view(lse.shape[0], b, sq).transpose(0, 1).contiguous()  # [batch, heads, seqlen]
    return out.view_as(q), lse, None, rng


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    rng_state=None,
):
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse = softmax_lse.transpose(0, 1).reshape(softmax_lse.shape[1], b * sq)  # [H, b*sq]
    d = _flash_attn_varlen_backward(
        _flatten(dout), _flatten(q), _flatten(k), _flatten(v), _flatten(out), lse,
        _flatten(gq), _flatten(gk), _flatten(gv), _batch_cu(b, sq), _batch_cu(b, sk), sq, sk,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
        alibi_slopes, deterministic,
    )
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return d.view(d.shape[0], b, sq).transpose(0, 1)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """The public varlen entry point; differentiable through autograd of the dense math
    (dropout too: its mask is kept for backward)."""
    assert alibi_slopes is None and not return_attn_probs
    _check_head_dims(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs = [
        _dense(q[qa:qb], k[ka:kb], v[ka:kb], scale, causal, tuple(window_size), softcap,
               dropout_p)[0]
        for qa, qb, ka, kb in _pairs(cu_seqlens_q, cu_seqlens_k)
        if qb > qa
    ]
    return torch.cat(outs)

"""Test-only CPU stand-in of ``aten._flash_attention_forward/backward`` (PyTorch's flash-attn 2).

Same signatures and conventions as the CUDA ops, for their varlen form (the one the
``torch_flash`` kernel calls), written as dense per-sequence math in float64:

* q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``, ``Hq % Hkv == 0`` (GQA: query head ``h``
  reads KV head ``h // (Hq / Hkv)``); ``cum_seq_q/k`` int32 ``[n + 1]`` starting at 0;
* ``is_causal`` forces ``window_size_right = 0``; ``None`` windows mean ``-1`` (unbounded);
  masks are aligned to the bottom right of each sequence (query ``i`` of ``Lq`` sits at key
  ``i + Lk - Lq``) and a window ``(left, right)`` lets it see keys ``at - left .. at + right``;
* the log-sum-exp is ``[Hq, total_q]`` float32; a row that sees no key gets output 0 and
  log-sum-exp ``+inf`` (flash-attn's convention);
* backward takes ``out`` and ``logsumexp`` as given (the merged ones, in our use) and computes
  ``P = exp(S - lse)``, ``dS = P * (dO V^T - rowsum(dO * out))``, as the CUDA kernel does;
* ``dropout_p > 0``: the forward draws a seed from the default generator and returns it as
  its philox seed; each sequence's keep mask ``[Hq, Lq, Lk]`` comes from a generator of that
  seed (:func:`keep_mask`), so the backward given the seed redraws it, as the CUDA op's
  philox does. The output is ``(P * keep / (1 - p)) V`` and the log-sum-exp the undropped one.

The kernel's contract checks (dtypes, int32 offsets, shapes, unit last stride) are asserted
so that a call the real op would reject fails here too. ``CALLS`` counts calls, so a test can
tell the op was used rather than a fallback.
"""

from __future__ import annotations

import torch

from longctx_cli.parallel.torch_flash import FlashOps

CALLS = {"forward": 0, "backward": 0}


def _check_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p) -> None:
    assert 0.0 <= dropout_p < 1.0
    assert query.dim() == 3 and key.dim() == 3 and value.dim() == 3, "varlen: [tokens, H, D]"
    assert query.dtype == key.dtype == value.dtype
    assert query.shape[-1] == key.shape[-1] == value.shape[-1]
    assert key.shape[:2] == value.shape[:2]
    assert query.shape[1] % key.shape[1] == 0, "GQA needs Hq % Hkv == 0"
    for t in (query, key, value):
        assert t.stride(-1) == 1, "the op reads rows with a unit last stride"
    for cu, total, max_len in ((cum_seq_q, query.shape[0], max_q), (cum_seq_k, key.shape[0],
                                                                      max_k)):
        assert cu is not None and cu.dtype == torch.int32 and cu.dim() == 1
        assert cu.device == query.device
        bounds = cu.tolist()
        assert bounds[0] == 0 and bounds[-1] == total, (bounds, total)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert min(lengths) >= 0 and max(lengths) <= max_len, (lengths, max_len)
    assert cum_seq_q.numel() == cum_seq_k.numel()


def _windows(is_causal: bool, left: int | None, right: int | None) -> tuple[int, int]:
    left = -1 if left is None else left
    right = 0 if is_causal else (-1 if right is None else right)
    return left, right


def _mask(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    at = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= at + right
    if left >= 0:
        keep &= j >= at - left
    return keep


def _scores(q, k, scale, keep) -> torch.Tensor:
    """``[H, Lq, Lk]`` float64 scores, masked with -inf; k already expanded to Hq heads."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    return s.masked_fill(~keep, float("-inf"))


def _pairs(cum_seq_q, cum_seq_k):
    bq, bk = cum_seq_q.tolist(), cum_seq_k.tolist()
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


def keep_mask(seed: int, index: int, heads: int, lq: int, lk: int, p: float) -> torch.Tensor:
    """The kept entries (1.0 or 0.0, float64) of sequence ``index`` of a call of ``seed``."""
    gen = torch.Generator().manual_seed(seed + index)
    return torch.empty(heads, lq, lk, dtype=torch.float64).bernoulli_(1 - p, generator=gen)


def flash_attention_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
    seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None,
):
    _check_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    assert not return_debug_mask and seqused_k is None and alibi_slopes is None
    assert block_table is None
    CALLS["forward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = _windows(is_causal, window_size_left, window_size_right)
    groups = query.shape[1] // key.shape[1]
    out = torch.zeros_like(query)
    lse = torch.full((query.shape[1], query.shape[0]), float("inf"), dtype=torch.float32)
    seed = int(torch.randint(0, 2**62, ())) if dropout_p else 0
    for index, (qa, qb, ka, kb) in enumerate(_pairs(cum_seq_q, cum_seq_k)):
        if qb == qa:
            continue
        k = key[ka:kb].repeat_interleave(groups, 1)
        v = value[ka:kb].repeat_interleave(groups, 1).double()
        s = _scores(query[qa:qb], k, scale, _mask(qb - qa, kb - ka, left, right))
        row_lse = torch.logsumexp(s, -1)  # -inf where a row sees nothing
        seen = row_lse.isfinite()
        p = torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None])
        if dropout_p:
            p = p * keep_mask(seed, index, *p.shape, dropout_p) / (1 - dropout_p)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p, v).to(query.dtype)
        lse[:, qa:qb] = torch.where(seen, row_lse, float("inf")).float()
    if dropout_p:
        return (out, lse, torch.tensor(seed), torch.tensor(0),
                torch.empty(0, dtype=query.dtype))
    rng = torch.zeros(2, dtype=torch.uint64)
    return out, lse, rng, torch.empty(0, dtype=torch.uint64), torch.empty(0, dtype=query.dtype)


def flash_attention_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
    window_size_right=None,
):
    _check_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    assert grad_out.shape == query.shape == out.shape and out.dtype == query.dtype
    assert grad_out.stride(-1) == 1 and out.stride(-1) == 1
    assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    assert tuple(logsumexp.shape) == (query.shape[1], query.shape[0]), "lse is [Hq, total_q]"
    assert rng_state is not None and unused is not None
    CALLS["backward"] += 1
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = _windows(is_causal, window_size_left, window_size_right)
    hq, hk = query.shape[1], key.shape[1]
    groups = hq // hk
    dq = torch.zeros(query.shape, dtype=torch.float64)
    dk = torch.zeros(key.shape[0], hq, key.shape[2], dtype=torch.float64)
    dv = torch.zeros_like(dk)
    for index, (qa, qb, ka, kb) in enumerate(_pairs(cum_seq_q, cum_seq_k)):
        if qb == qa:
            continue
        k = key[ka:kb].repeat_interleave(groups, 1).double()
        v = value[ka:kb].repeat_interleave(groups, 1).double()
        q, do, o = (t[qa:qb].double() for t in (query, grad_out, out))
        s = _scores(q, k, scale, _mask(qb - qa, kb - ka, left, right))
        row_lse = logsumexp[:, qa:qb].double()
        p = torch.exp(s - torch.where(row_lse.isfinite(), row_lse, 0.0)[..., None])
        p = torch.where(row_lse.isfinite()[..., None], p, 0.0)
        kept = (keep_mask(int(rng_state), index, *p.shape, dropout_p) / (1 - dropout_p)
                if dropout_p else 1.0)  # the forward's mask, from its seed
        dv[ka:kb] += torch.einsum("hqk,qhd->khd", p * kept, do)
        dp = torch.einsum("qhd,khd->hqk", do, v) * kept
        delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # [H, Lq, 1]
        ds = p * (dp - delta) * scale
        dq[qa:qb] += torch.einsum("hqk,khd->qhd", ds, k)
        dk[ka:kb] += torch.einsum("hqk,qhd->khd", ds, q)
    dk = dk.view(key.shape[0], hk, groups, key.shape[2]).sum(2)
    dv = dv.view(key.shape[0], hk, groups, key.shape[2]).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


OPS = FlashOps(
    forward=flash_attention_forward,
    backward=flash_attention_backward,
    supports=lambda q: q.shape[-1] % 8 == 0 and q.shape[-1] <= 256,  # any device and dtype
    name="tests.torch_flash_standin",
)

"""The SP attention cases every strategy's tests share, and the dense reference they are
checked against (float64, a full T x T same-document causal mask: rows are small).

``FEATURES`` adds what model layers ask for: a sliding window shorter and longer than the
documents, logit softcapping, attention sinks, and all of them at once. The reference
writes each from the math (explicit window mask, ``cap * tanh(s / cap)``, an extra
value-less logit per head in the softmax), sharing no code with the kernels.
"""

from __future__ import annotations

import dataclasses

import torch

from longctx_cli.parallel import (
    AttentionFeatures,
    ParallelState,
    gather_sequence,
    shard_batch,
    slice_sequence,
    sp_attention,
)

TOL = 1e-5
DIM = 16

# name -> (document lengths, query heads, kv heads). Lengths are chosen against the rank
# boundaries of a 64-token row: 16/32/48 (contiguous sp=4), 8k (zigzag sp=4), 32 (sp=2).
CASES: dict[str, tuple[list[int], int, int]] = {
    "causal": ([64], 4, 4),
    "packed_inside": ([10, 27, 5, 22], 4, 4),
    "packed_on_boundaries": ([16, 16, 8, 8, 16], 4, 4),
    "one_token_docs": ([1, 1, 14, 1, 1, 30, 1, 15], 4, 4),
    "padding_tail": ([20, 30, 9], 4, 4),  # 59 tokens, padded to 64
    "spans_all_ranks": ([3, 58, 3], 4, 4),
    "gqa_8q_2kv": ([12, 40, 12], 8, 2),
    "gqa_8q_4kv": ([7, 33, 24], 8, 4),
}


def doc_lengths_to_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


# name -> (window, softcap, with sinks). Windows: 5 is shorter than most documents (and than
# every rank's share), 40 cuts only the longest ones.
FEATURES: dict[str, tuple[int | None, float | None, bool]] = {
    "plain": (None, None, False),
    "window5": (5, None, False),
    "window40": (40, None, False),
    "softcap": (None, 1.5, False),
    "sinks": (None, None, True),
    "all": (7, 1.5, True),
}

# The feature cases run over these cases only (every layout and boundary kind, GQA).
FEATURE_CASES = ("packed_inside", "one_token_docs", "spans_all_ranks", "gqa_8q_2kv")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Dense attention with a same-document causal mask; q/k/v ``[T, H, D]`` (v may have its
    own head dim, as in multi-head latent attention), sinks ``[H]``.

    window: query ``i`` sees keys ``j`` with ``i - window < j <= i`` (transformers'
    sliding-window mask), never before its document start. chunk: only keys whose position
    in the document is in the query's chunk, ``pos // chunk`` equal (Llama 4's chunked
    attention over one document).
    """
    doc = torch.cumsum((position_ids == 0).long(), 0)
    t = position_ids.numel()
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j <= i)
    if window is not None:
        allowed &= j > i - window
    if chunk is not None:
        allowed &= position_ids[:, None] // chunk == position_ids[None, :] // chunk
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more logit per (head, query), whose value is zero
        sink_col = sinks.to(scores.dtype)[:, None, None].expand(-1, t, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def make_inputs(lengths: list[int], hq: int, hkv: int, multiple: int, seed: int,
                v_dim: int = DIM):
    """Full padded row of positions plus random q/k/v/dout (identical on every rank).

    ``v_dim``: the value (and output) head dim; q/k have ``DIM`` (MLA: they differ)."""
    pos = doc_lengths_to_positions(lengths)
    extra = -pos.numel() % multiple
    pos_padded = torch.cat([pos, torch.arange(extra)]) if extra else pos
    t = pos_padded.numel()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, DIM, generator=g)
    dout = torch.randn(t, hq, v_dim, generator=g) if v_dim != DIM else torch.randn(
        t, hq, DIM, generator=g)
    k = torch.randn(t, hkv, DIM, generator=g)
    v = torch.randn(t, hkv, v_dim, generator=g)
    return pos, pos_padded, q, k, v, dout


def run_case(
    ctx: ParallelState,
    lengths: list[int],
    hq: int,
    hkv: int,
    seed: int,
    window: int | None = None,
    softcap: float | None = None,
    with_sinks: bool = False,
    autocast: torch.dtype | None = None,
    q_scale: float = 1.0,
    row_meta_on: str | None = None,
    chunk: int | None = None,
    v_dim: int = DIM,
    spent: bool = False,
) -> dict:
    """SP attention for one case; relative errors of out, dq, dk, dv (and dsinks) vs reference.

    ``autocast``: q/k/v/dout are rounded to that dtype and the SP call runs under CPU
    autocast to it, as in half-precision training; the reference stays float64 on the same
    rounded values. ``q_scale`` multiplies q (larger scores magnify rounding in them).
    ``row_meta_on``: move the row's cu_seqlens tensor to that device first ("meta": any
    read of its values, ``.tolist()`` or ``.item()``, raises). ``chunk``: Llama 4's chunked
    attention; ``v_dim``: a value head dim unlike q/k's ``DIM`` (multi-head latent attention).
    ``spent``: the call may write over q, k and v, as in a model layer that reads them no more
    (handed over as tensors of their own memory: q and v heads-major as transformers lays them
    out, k token-major; gradients reach the leaves through them).
    """
    multiple = ctx.layout.sp * (2 if ctx.layout.sharding == "zigzag" else 1)
    pos, pos_padded, q, k, v, dout = make_inputs(lengths, hq, hkv, multiple, seed, v_dim)
    q = q * q_scale
    if autocast is not None:
        q, k, v, dout = (x.to(autocast) for x in (q, k, v, dout))
    sink_gen = torch.Generator().manual_seed(seed + 1000)
    sinks = 1 + torch.randn(hq, generator=sink_gen) if with_sinks else None
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, pos, ids, ctx).sp_meta
    if row_meta_on is not None:
        meta = dataclasses.replace(meta, cu_seqlens=meta.cu_seqlens.to(row_meta_on))
    scale = DIM**-0.5
    feats = AttentionFeatures(scale=scale, window=window, softcap=softcap, chunk=chunk,
                              spent=spent)
    local = [slice_sequence(x, ctx).clone().requires_grad_() for x in (q, k, v)]
    inputs = local
    if spent:
        heads_major = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in local]
        inputs = [heads_major[0], local[1] * 1, heads_major[2]]
    sink_leaf = None if sinks is None else sinks.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = sp_attention(*inputs, meta, feats, sink_leaf)
    out.backward(slice_sequence(dout, ctx))
    got = [gather_sequence(x, ctx) for x in (out.detach(), *(t.grad for t in local))]
    if sink_leaf is not None:  # each rank holds its tokens' share, as for any parameter
        dsinks = sink_leaf.grad.clone()
        if ctx.layout.sp > 1:
            torch.distributed.all_reduce(dsinks, group=ctx.sp_group)
        got.append(dsinks)

    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.double().requires_grad_()
    ref_out = reference_attention(*full, pos_padded, scale, window, softcap, ref_sinks, chunk)
    ref_out.backward(dout.double())
    want = [ref_out.detach(), *(t.grad for t in full)]
    names = ["out", "dq", "dk", "dv"]
    if ref_sinks is not None:
        want.append(ref_sinks.grad)
        names.append("dsinks")
    return {n: rel_err(a, b) for n, a, b in zip(names, got, want, strict=True)}


def feature_runs(ctx: ParallelState, prefix: str) -> dict[str, dict]:
    """Every feature combination over ``FEATURE_CASES`` for one context."""
    errors = {}
    for f, (window, softcap, sinks) in FEATURES.items():
        for i, name in enumerate(FEATURE_CASES):
            lengths, hq, hkv = CASES[name]
            errors[f"{prefix}/{f}/{name}"] = run_case(
                ctx, lengths, hq, hkv, 200 + i, window, softcap, sinks
            )
    return errors


def assert_all_close(errors: dict[str, dict]) -> None:
    bad = {case: e for case, e in errors.items() if max(e.values()) >= TOL}
    assert not bad, f"relative errors >= {TOL}: {bad}"

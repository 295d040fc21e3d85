"""The SP attention cases every strategy's tests share, and the dense reference they are
checked against (float64, a full T x T same-document causal mask: rows are small)."""

from __future__ import annotations

import torch

from longctx_cli.parallel import (
    SPContext,
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


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention with a same-document causal mask; q/k/v ``[T, H, D]``."""
    doc = torch.cumsum((position_ids == 0).long(), 0)
    t = position_ids.numel()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def make_inputs(lengths: list[int], hq: int, hkv: int, multiple: int, seed: int):
    """Full padded row of positions plus random q/k/v/dout (identical on every rank)."""
    pos = doc_lengths_to_positions(lengths)
    extra = -pos.numel() % multiple
    pos_padded = torch.cat([pos, torch.arange(extra)]) if extra else pos
    t = pos_padded.numel()
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(t, hq, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(t, hkv, DIM, generator=g) for _ in range(2))
    return pos, pos_padded, q, k, v, dout


def run_case(ctx: SPContext, lengths: list[int], hq: int, hkv: int, seed: int) -> dict:
    """SP attention for one case; returns relative errors of out, dq, dk, dv vs reference."""
    multiple = ctx.sp_size * (2 if ctx.layout == "zigzag" else 1)
    pos, pos_padded, q, k, v, dout = make_inputs(lengths, hq, hkv, multiple, seed)
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, pos, ids, ctx).sp_meta
    scale = DIM**-0.5
    local = [slice_sequence(x, ctx).clone().requires_grad_() for x in (q, k, v)]
    out = sp_attention(*local, meta, scale)
    out.backward(slice_sequence(dout, ctx))
    got = [gather_sequence(x, ctx) for x in (out.detach(), *(t.grad for t in local))]

    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = reference_attention(*full, pos_padded, scale)
    ref_out.backward(dout.double())
    want = [ref_out.detach(), *(t.grad for t in full)]
    return {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}


def assert_all_close(errors: dict[str, dict]) -> None:
    bad = {case: e for case, e in errors.items() if max(e.values()) >= TOL}
    assert not bad, f"relative errors >= {TOL}: {bad}"

"""Ring attention (torch kernel) at sp=2 and sp=4 equals single-process attention, exactly.

Every case compares the gathered output and dq/dk/dv with a dense per-document causal
reference computed here in float64 on the full row (rows are small, so a T x T mask is fine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx_cli.parallel import (
    SPContext,
    build_parallel_groups,
    gather_sequence,
    shard_batch,
    single_process_context,
    slice_sequence,
    sp_attention,
)
from tests.distributed import run_distributed

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


def all_runs(ctx: SPContext) -> dict[str, dict]:
    """Every case x every heads_k_stride dividing the KV heads, for one context."""
    errors = {}
    for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
        for stride in [s for s in range(1, hkv + 1) if hkv % s == 0]:
            sub = dataclasses.replace(ctx, heads_k_stride=stride)
            errors[f"{ctx.layout}/{name}/stride{stride}"] = run_case(sub, lengths, hq, hkv, i)
    return errors


def ring_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors = {}
    for layout in ("contiguous", "zigzag"):
        _, ctx = build_parallel_groups(sp=world_size, layout=layout, kernel="torch")
        errors.update(all_runs(ctx))
    return errors


def assert_all_close(errors: dict[str, dict]) -> None:
    bad = {case: e for case, e in errors.items() if max(e.values()) >= TOL}
    assert not bad, f"relative errors >= {TOL}: {bad}"


@pytest.mark.parametrize("sp", [2, 4])
def test_ring_attention_matches_single_process(sp: int) -> None:
    results = run_distributed(ring_worker, sp, timeout_s=180)
    assert len(results[0]) == 2 * sum(
        len([s for s in range(1, h + 1) if h % s == 0]) for _, _, h in CASES.values()
    )
    for errors in results:  # every rank gathered the same full tensors
        assert_all_close(errors)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_path_matches_reference(layout: str) -> None:
    """sp == 1 without torch.distributed: the same entry point, no communication."""
    ctx = single_process_context(layout=layout, heads_k_stride=1)
    assert ctx.sp_group is None
    for i, (lengths, hq, hkv) in enumerate(CASES.values()):
        errors = run_case(ctx, lengths, hq, hkv, seed=100 + i)
        assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("causal", [True, False])
def test_generic_block_math_matches_cpu_kernel(causal: bool) -> None:
    """The matmul path used on devices without the CPU flash op gives the same blocks."""
    from longctx_cli.parallel import kernels

    g = torch.Generator().manual_seed(7)
    n_k = 24 if not causal else 16  # causal blocks are square (the diagonal)
    q = torch.randn(1, 8, 16, DIM, generator=g)
    k, v = (torch.randn(1, 2, n_k, DIM, generator=g) for _ in range(2))
    dout = torch.randn(1, 8, 16, DIM, generator=g)
    out, lse = kernels._FWD(q, k, v, 0.0, causal, scale=0.3)
    out_g, lse_g = kernels._block_fwd_generic(q, k, v, causal, 0.3)
    assert rel_err(out_g, out) < TOL and rel_err(lse_g, lse) < TOL
    grads = kernels._BWD(dout, q, k, v, out, lse, 0.0, causal, scale=0.3)
    grads_g = kernels._block_bwd_generic(dout, q, k, v, out, lse, causal, 0.3)
    for a, b in zip(grads_g, grads, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL

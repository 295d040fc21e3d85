"""Activations saved for backward by SP attention shrink as 1/N: full-length K,V are not kept."""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from longctx_cli.parallel import shard_batch, slice_sequence, sp_attention
from tests.distributed import run_distributed
from tests.layouts import sp_state

TOKENS, HEADS, KV_HEADS, DIM = 4096, 8, 2, 32
DOCS = [1000, 2500, 596]  # packed documents crossing rank boundaries


def saved_bytes_of_attention(ctx) -> int:
    """Bytes of every tensor autograd saves during one SP attention forward on this rank."""
    pos = torch.cat([torch.arange(n) for n in DOCS])
    meta = shard_batch(torch.zeros_like(pos), pos, torch.zeros_like(pos), ctx).sp_meta
    g = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS, DIM, generator=g)
    k, v = (torch.randn(TOKENS, KV_HEADS, DIM, generator=g) for _ in range(2))
    local = [slice_sequence(x, ctx).requires_grad_() for x in (q, k, v)]
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = sp_attention(*local, meta, DIM**-0.5)
    out.sum().backward()  # the saved tensors suffice for backward
    assert local[1].grad is not None and local[1].grad.shape == local[1].shape
    return total


def memory_worker(rank: int, world_size: int) -> dict[str, int]:
    result = {}
    for layout in ("contiguous", "zigzag"):
        ctx = sp_state(sp=world_size, layout=layout, heads_k_stride=1)
        result[layout] = saved_bytes_of_attention(ctx)
    return result


def test_saved_activations_scale_inversely_with_sp() -> None:
    single = sp_state(sp=1, kernel="torch")
    full = saved_bytes_of_attention(single)
    # q, k, v, out and the log-sum-exp of the whole row at least
    assert full >= TOKENS * (2 * HEADS + 2 * KV_HEADS) * DIM * 4
    for per_rank in run_distributed(memory_worker, 4, timeout_s=120):
        for layout, saved in per_rank.items():
            # 1/4 of the row's q, k, v, out, lse: nothing full-length is kept
            assert 0.2 * full <= saved <= 0.3 * full, (layout, saved, full)

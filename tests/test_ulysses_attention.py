"""Ulysses attention (torch kernel) equals single-process attention, exactly.

The cases and the dense float64 reference are the ring tests' (same rows, same documents
across rank boundaries, one-token documents, padding tail, GQA); here they run through the
all-to-all strategy at sp=4 and at dp=2 x sp=2, contiguous and zigzag, in one spawned run.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel import (
    SPContext,
    build_parallel_groups,
    make_sp_meta,
    shard_batch,
    slice_sequence,
    sp_attention,
)
from longctx_cli.parallel.ulysses import build_exchange, kv_replication
from tests.distributed import run_distributed
from tests.test_ring_attention import CASES, DIM, assert_all_close, run_case

LAYOUTS = ("contiguous", "zigzag")


def strided_like_transformers(x: torch.Tensor) -> torch.Tensor:
    """The same values as the ``[T, H, D]`` view transformers hands over (heads-major memory)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def strided_input_matches(ctx: SPContext) -> float:
    """Max difference between contiguous and heads-major inputs (must be exactly equal)."""
    lengths, hq, hkv = CASES["gqa_8q_2kv"]
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, pos, ids, ctx).sp_meta
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(pos.numel(), h, DIM, generator=g) for h in (hq, hkv, hkv)]
    local = [slice_sequence(x, ctx) for x in full]
    a = sp_attention(*local, meta, DIM**-0.5)
    b = sp_attention(*(strided_like_transformers(x) for x in local), meta, DIM**-0.5)
    return float((a - b).abs().max())


def ulysses_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors: dict[str, dict] = {}
    for sp in (world_size, 2):  # sp=4, then dp=2 x sp=2 on the same 4 processes
        for layout in LAYOUTS:
            _, ctx = build_parallel_groups(sp=sp, mode="ulysses", layout=layout, kernel="torch")
            for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                errors[f"sp{sp}/{layout}/{name}"] = run_case(ctx, lengths, hq, hkv, seed=i)
            diff = strided_input_matches(ctx)
            errors[f"sp{sp}/{layout}/strided_input"] = {"max_abs_diff": diff}
    return errors


def test_ulysses_attention_matches_single_process() -> None:
    results = run_distributed(ulysses_worker, 4, timeout_s=240)
    assert len(results[0]) == 2 * len(LAYOUTS) * (len(CASES) + 1)
    for errors in results:  # every rank gathered the full tensors of its SP group
        assert_all_close(errors)


@pytest.mark.parametrize(
    ("hq", "hkv", "size", "copies"),
    [(8, 8, 4, 1), (8, 2, 4, 2), (8, 1, 4, 4), (16, 4, 2, 1), (32, 8, 16, 2)],
)
def test_kv_replication_gives_whole_heads(hq: int, hkv: int, size: int, copies: int) -> None:
    assert kv_replication(hq, hkv, size) == copies
    assert (hkv * copies) % size == 0


@pytest.mark.parametrize(
    ("hq", "hkv", "size", "message"),
    [
        (6, 6, 4, "divisible by its group size 4"),
        (12, 3, 2, "cannot split 3 key/value heads over a group of 2"),
        (8, 3, 4, "multiple of key/value heads"),
    ],
)
def test_kv_replication_refuses_impossible_splits(
    hq: int, hkv: int, size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        kv_replication(hq, hkv, size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exchange_puts_tokens_in_global_order(layout: str) -> None:
    """Pieces received from the 4 ranks, once reordered, tile the row in ascending order."""
    total = 64
    for rank in range(4):
        ctx = SPContext(sp_rank=rank, sp_size=4, mode="ulysses", layout=layout)
        ex = build_exchange(make_sp_meta(torch.arange(total), ctx), None, 4)
        assert ex.starts == tuple(range(0, total, ex.piece_len))
        assert ex.identity == (layout == "contiguous")

"""Hybrid (Ulysses x ring) attention equals single-process attention, exactly.

sp=4 as 2 Ulysses groups of 2 (the 2x2 split), contiguous and zigzag, every heads_k_stride
that divides the model's KV heads; also the degenerate splits U=4 (no ring) and U=1 (no
all-to-all) through the same code, and the 2x2 split with the exchange written over q, k, v
(as in a layer that reads them no more). One spawned run of 4 processes.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel import make_sp_meta
from longctx_cli.parallel.ulysses import build_exchange
from longctx_cli.parallel.ulysses_ring import ring_meta
from tests.attention_cases import (
    CASES,
    FEATURE_CASES,
    FEATURES,
    assert_all_close,
    feature_runs,
    run_case,
)
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state

LAYOUTS = ("contiguous", "zigzag")


def divisors(n: int) -> list[int]:
    return [s for s in range(1, n + 1) if n % s == 0]


def hybrid_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors: dict[str, dict] = {}
    for u in (2, 4, 1):
        for layout in LAYOUTS:
            ctx = sp_state(
                sp=world_size, mode="hybrid", ulysses_degree=u, layout=layout, kernel="torch"
            )
            for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                strides = divisors(hkv) if u == 2 else [1]
                for stride in strides:
                    sub = ctx.with_layout(heads_k_stride=stride)
                    key = f"u{u}/{layout}/{name}/stride{stride}"
                    errors[key] = run_case(sub, lengths, hq, hkv, seed=i)
            if u == 2:  # the real 2x2 split: windows, softcap and sinks through both halves
                errors.update(feature_runs(ctx, f"u{u}/{layout}/features"))
                for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                    errors[f"u{u}/{layout}/{name}/spent"] = run_case(ctx, lengths, hq, hkv,
                                                                     seed=i, spent=True)
    return errors


def expected_count() -> int:
    per_layout = sum(len(divisors(h)) for _, _, h in CASES.values()) + 3 * len(CASES)
    return len(LAYOUTS) * (per_layout + len(FEATURES) * len(FEATURE_CASES))


def test_hybrid_attention_matches_single_process() -> None:
    results = run_distributed(hybrid_worker, 4, timeout_s=240)
    assert len(results[0]) == expected_count()
    for errors in results:
        assert_all_close(errors)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ulysses_groups_hold_what_the_ring_expects(layout: str) -> None:
    """sp=8 as 2 Ulysses groups of 4: each group gathers exactly its ring shard."""
    total, sp, u = 128, 8, 4
    for rank in range(sp):
        ctx = rank_state(sp_rank=rank, sp_size=sp, mode="hybrid", layout=layout, ulysses_degree=u)
        meta = make_sp_meta(torch.arange(total), ctx)
        derived = ring_meta(meta, local_kv_heads=2)  # raises if the two layouts disagree
        assert derived.ctx.layout.sp == sp // u and derived.ctx.sp_rank == rank // u
        ex = build_exchange(meta, None, u)
        held = sum(ex.piece_len for _ in ex.starts)
        assert held == derived.local_len == total * u // sp


def test_heads_k_stride_is_reduced_to_the_local_kv_heads() -> None:
    ctx = rank_state(sp_rank=0, sp_size=4, mode="hybrid", heads_k_stride=4, ulysses_degree=2)
    meta = make_sp_meta(torch.arange(64), ctx)
    assert ring_meta(meta, local_kv_heads=2).ctx.layout.heads_k_stride == 2
    assert ring_meta(meta, local_kv_heads=1).ctx.layout.heads_k_stride == 1

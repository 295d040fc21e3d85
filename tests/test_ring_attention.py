"""Ring attention (torch kernel) at sp=2 and sp=4 equals single-process attention, exactly.

Every case compares the gathered output and dq/dk/dv with the dense per-document causal
reference of `tests/attention_cases.py`; the feature cases (sliding windows, softcap,
sinks, all combined) compare d sinks too.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel.mesh import ParallelState
from tests.attention_cases import (
    CASES,
    DIM,
    FEATURE_CASES,
    FEATURES,
    TOL,
    assert_all_close,
    feature_runs,
    rel_err,
    run_case,
)
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state


def all_runs(ctx: ParallelState) -> dict[str, dict]:
    """Every case x every heads_k_stride dividing the KV heads, for one context."""
    errors = {}
    for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
        for stride in [s for s in range(1, hkv + 1) if hkv % s == 0]:
            sub = ctx.with_layout(heads_k_stride=stride)
            key = f"{ctx.layout.sharding}/{name}/stride{stride}"
            errors[key] = run_case(sub, lengths, hq, hkv, i)
    return errors


def spent_runs(ctx: ParallelState) -> dict[str, dict]:
    """Every case with q, k, v handed over spent (gradients written over them), one KV head
    per group (a group's heads written while the next group's are gathered), and the feature
    cases with a window, softcap and sinks at once."""
    sub = ctx.with_layout(heads_k_stride=1)
    errors = {}
    for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
        errors[f"{ctx.layout.sharding}/{name}/spent"] = run_case(sub, lengths, hq, hkv, i,
                                                                 spent=True)
    window, softcap, sinks = FEATURES["all"]
    for i, name in enumerate(FEATURE_CASES):
        lengths, hq, hkv = CASES[name]
        errors[f"{ctx.layout.sharding}/{name}/all/spent"] = run_case(
            sub, lengths, hq, hkv, 50 + i, window=window, softcap=softcap, with_sinks=sinks,
            spent=True)
    return errors


def ring_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors = {}
    for layout in ("contiguous", "zigzag"):
        ctx = sp_state(sp=world_size, layout=layout, kernel="torch")
        errors.update(all_runs(ctx))
        errors.update(feature_runs(ctx, f"{layout}/features"))
        errors.update(spent_runs(ctx))
    return errors


@pytest.mark.parametrize("sp", [2, 4])
def test_ring_attention_matches_single_process(sp: int) -> None:
    results = run_distributed(ring_worker, sp, timeout_s=180)
    assert len(results[0]) == 2 * sum(
        len([s for s in range(1, h + 1) if h % s == 0]) for _, _, h in CASES.values()
    ) + 2 * len(FEATURES) * len(FEATURE_CASES) + 2 * (len(CASES) + len(FEATURE_CASES))
    for errors in results:  # every rank gathered the same full tensors
        assert_all_close(errors)


def in_place_worker(rank: int, world_size: int) -> dict[str, bool]:
    """Spent inputs end up holding their own gradients (the ring wrote there), equal to the
    gradients of the same call with inputs it may not write over; not spent, they keep
    their values."""
    from longctx_cli.parallel import AttentionFeatures, shard_batch, slice_sequence, sp_attention

    lengths, hq, hkv = [12, 40, 12], 8, 2  # packed, GQA: two groups at stride 1
    pos = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(pos.numel(), h, DIM, generator=g) for h in (hq, hkv, hkv)]
    dout = torch.randn(pos.numel(), hq, DIM, generator=g)
    found = {}
    for layout in ("contiguous", "zigzag"):
        for stride in (1, 2):
            ctx = sp_state(sp=world_size, layout=layout, kernel="torch", heads_k_stride=stride)
            meta = shard_batch(torch.zeros_like(pos), pos, torch.zeros_like(pos), ctx).sp_meta
            grads = {}
            for spent in (False, True):
                leaves = [slice_sequence(x, ctx).clone().requires_grad_() for x in full]
                # q heads-major as transformers lays it out, k and v token-major
                inputs = [leaves[0].transpose(0, 1).contiguous().transpose(0, 1),
                          leaves[1] * 1, leaves[2] * 1]
                before = [t.detach().clone() for t in inputs]
                feats = AttentionFeatures(scale=DIM**-0.5, window=9, spent=spent)
                sp_attention(*inputs, meta, feats).backward(slice_sequence(dout, ctx))
                grads[spent] = [t.grad for t in leaves]
                key = f"{layout}/stride{stride}/spent{spent}"
                held = before if not spent else grads[spent]
                found[key] = all(torch.equal(t.detach(), h) for t, h in zip(inputs, held,
                                                                             strict=True))
            found[f"{layout}/stride{stride}/equal"] = all(
                torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))
    return found


def test_spent_inputs_take_their_gradients_in_place() -> None:
    for found in run_distributed(in_place_worker, 2, timeout_s=120):
        assert len(found) == 12 and all(found.values()), found


def test_chunks_are_permuted_in_place() -> None:
    from longctx_cli.layout import zigzag_order
    from longctx_cli.parallel.sharding import permute_chunks_, zigzag_positions

    for n in (1, 2, 3, 4):
        x = torch.arange(2 * n * 3 * 2).reshape(2 * n * 3, 2)
        for order in (zigzag_order(n), zigzag_positions(n), list(range(2 * n))[::-1]):
            want = torch.cat([x.chunk(2 * n)[j] for j in order])
            y = x.clone()
            assert permute_chunks_(y, order) is y and torch.equal(y, want), (n, order)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_path_matches_reference(layout: str) -> None:
    """sp == 1 without torch.distributed: the same entry point, no communication."""
    ctx = rank_state(layout=layout, heads_k_stride=1)
    assert ctx.sp_group is None
    for i, (lengths, hq, hkv) in enumerate(CASES.values()):
        errors = run_case(ctx, lengths, hq, hkv, seed=100 + i)
        assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_features_match_reference(layout: str) -> None:
    ctx = rank_state(layout=layout, heads_k_stride=1)
    assert_all_close(feature_runs(ctx, layout))


def test_small_blocks_and_tiles_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row blocks and score tiles far smaller than the documents: every merge path runs."""
    from longctx_cli.parallel import block_geometry, tiled

    monkeypatch.setattr(block_geometry, "MAX_ROWS", 3)
    monkeypatch.setattr(tiled, "TILE", 4)
    ctx = rank_state(layout="contiguous", heads_k_stride=1)
    assert_all_close(feature_runs(ctx, "small"))


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("shape", ["diagonal", "prefix", "edge"])
def test_matmul_path_matches_cpu_kernel(shape: str, window: int | None) -> None:
    """The matmul path (CUDA, softcap) gives the CPU op's blocks, masks included."""
    from longctx_cli.parallel import AttentionFeatures, cpu_flash, tiled
    from longctx_cli.parallel.block_geometry import Block

    g = torch.Generator().manual_seed(7)
    # rows 0..7 sit at key positions 10..17; keys start at 10 (diagonal), 0 (prefix), 6 (edge)
    blk = {
        "diagonal": Block(0, 8, 10, 18, 10, True),
        "prefix": Block(0, 8, 0, 10, 10, False),
        "edge": Block(0, 7, 10 - 3 + 1, 10 + 8 - 3, 10, True),
    }[shape]
    if shape == "edge" and window is None:
        pytest.skip("edge blocks exist only under a window")
    feats = AttentionFeatures(scale=0.3, window=window)
    rows, keys = blk.q1 - blk.q0, blk.k1 - blk.k0
    q = torch.randn(1, 8, rows, DIM, generator=g)
    k, v = (torch.randn(1, 2, keys, DIM, generator=g) for _ in range(2))
    dout = torch.randn(1, 8, rows, DIM, generator=g)
    out, lse = cpu_flash.block_forward(q, k, v, blk, feats)
    out_g, lse_g = tiled.block_forward(q, k, v, blk, feats)
    assert rel_err(out_g, out) < TOL and rel_err(lse_g, lse) < TOL
    grads = cpu_flash.block_backward(dout, q, k, v, out, lse, blk, feats)
    grads_g = tiled.block_backward(dout, q, k, v, out, lse, blk, feats)
    for a, b in zip(grads_g, grads, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL

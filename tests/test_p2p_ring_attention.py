"""The P2P ring (batch_ring / batch_zigzag / batch_stripe) equals single-process attention.

Multi-process gloo runs at sp=2 and sp=4, dp=2 x sp=2 and hybrid (Ulysses x P2P ring):
out, dq, dk, dv (and d sinks) of every case of `tests/attention_cases.py` against the dense
per-document reference, fp32, relative error < 1e-5. Packed rows, documents crossing rank
boundaries, one-token documents, GQA, sliding windows, softcap and sinks.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.layout import P2P_SHARDING
from longctx_cli.parallel import AttentionFeatures, make_sp_meta
from longctx_cli.parallel.block_geometry import Piece, full_row_segments, piece_blocks
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.ring_p2p import step_geometry
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

FUNCS = tuple(P2P_SHARDING)  # batch_ring, batch_zigzag, batch_stripe


def all_cases(ctx: ParallelState, prefix: str) -> dict[str, dict]:
    errors = {
        f"{prefix}/{name}": run_case(ctx, lengths, hq, hkv, i)
        for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items())
    }
    errors.update(feature_runs(ctx, f"{prefix}/features"))
    return errors


def p2p_worker(rank: int, world_size: int, sp: int, funcs: tuple[str, ...]) -> dict:
    errors = {}
    for func in funcs:
        ctx = sp_state(
            sp=sp, layout=P2P_SHARDING[func], ring_attn_func=func, kernel="torch"
        )
        assert ctx.layout.p2p
        errors.update(all_cases(ctx, f"dp{world_size // sp}_sp{sp}/{func}"))
    return errors


def expected(funcs: tuple[str, ...]) -> int:
    return len(funcs) * (len(CASES) + len(FEATURES) * len(FEATURE_CASES))


@pytest.mark.parametrize("sp", [2, 4])
def test_p2p_ring_matches_single_process(sp: int) -> None:
    results = run_distributed(p2p_worker, sp, sp, FUNCS, timeout_s=240)
    assert len(results[0]) == expected(FUNCS)
    for errors in results:
        assert_all_close(errors)


def test_p2p_ring_dp2_x_sp2() -> None:
    """Two SP groups side by side: each ring stays inside its own group."""
    funcs = ("batch_zigzag", "batch_stripe")
    results = run_distributed(p2p_worker, 4, 2, funcs, timeout_s=240)
    for errors in results:
        assert len(errors) == expected(funcs)
        assert_all_close(errors)


def hybrid_worker(rank: int, world_size: int) -> dict:
    errors = {}
    for func in ("batch_ring", "batch_zigzag"):
        ctx = sp_state(
            sp=world_size, mode="hybrid", ulysses_degree=2, layout=P2P_SHARDING[func],
            ring_attn_func=func, kernel="torch",
        )
        errors.update(all_cases(ctx, f"hybrid2x2/{func}"))
    return errors


def test_hybrid_with_p2p_ring_matches_single_process() -> None:
    results = run_distributed(hybrid_worker, 4, timeout_s=240)
    for errors in results:
        assert len(errors) == expected(("batch_ring", "batch_zigzag"))
        assert_all_close(errors)


@pytest.mark.parametrize("func", FUNCS)
def test_single_process_p2p_matches_reference(func: str) -> None:
    """sp == 1 (no ring): the same entry point and pieces, no communication."""
    ctx = rank_state(layout=P2P_SHARDING[func], ring_attn_func=func)
    assert_all_close(all_cases(ctx, func))


def _visible_pairs(pieces, window) -> set[tuple[int, int]]:
    pairs = set()
    for group in (g for p in pieces for g in piece_blocks(p, window)):
        for blk in group:
            for row in range(blk.q0, blk.q1):
                pos = blk.pos + row - blk.q0
                for key in range(blk.k0, blk.k1):
                    if not blk.masked or (key <= pos and (window is None or key > pos - window)):
                        assert (row, key) not in pairs, "a key counted twice"
                        pairs.add((row, key))
    return pairs


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_every_rank_pair_sees_exactly_its_keys(sp: int, layout: str, window: int | None) -> None:
    """Over all ring steps, the pieces name exactly the (query, key) pairs of the full mask."""
    lengths = [1, 13, 2, 30, 5, 1, 20]
    total = sum(lengths) + (-sum(lengths) % (2 * sp))
    lengths.append(total - sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    func = {v: k for k, v in P2P_SHARDING.items()}[layout]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    feats = AttentionFeatures(scale=1.0, window=window)
    for r in range(sp):
        ctx = rank_state(sp_rank=r, sp_size=sp, layout=layout, ring_attn_func=func)
        meta = make_sp_meta(pos, ctx)
        got = set()
        for step in range(sp):
            s = (r - step) % sp
            pieces, step_feats = step_geometry(meta, step, feats)
            src_meta = make_sp_meta(pos, rank_state(sp_rank=s, sp_size=sp, layout=layout))
            q_glob = [g for a, b in meta.local_ranges for g in range(a, b)]
            k_glob = [g for a, b in src_meta.local_ranges for g in range(a, b)]
            got |= {(q_glob[i], k_glob[j]) for i, j in _visible_pairs(pieces, step_feats.window)}
        want = {
            (qg, kg)
            for a, b in meta.local_ranges
            for qg in range(a, b)
            for kg in range(total)
            if doc[kg] == doc[qg] and kg <= qg and (window is None or kg > qg - window)
        }
        assert got == want, (r, sorted(got ^ want)[:10])


def test_piece_rows_before_or_far_after_keys_get_nothing() -> None:
    # rows at key positions 0..9, keys 4..6, window 3: rows 4..8 see some (8 sees key 6)
    groups = piece_blocks(Piece(0, 10, 0, 4, 7), 3)
    rows = {r for g in groups for b in g for r in range(b.q0, b.q1)}
    assert rows == set(range(4, 9))
    assert piece_blocks(Piece(0, 5, 0, 7, 9), None) == []  # keys after every row
    assert full_row_segments([0, 3])  # the Segment path is still what full rows use

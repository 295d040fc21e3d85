"""Row sharding: padding, global cu_seqlens, the single global label shift, layouts, groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_cli.parallel import shard_batch
from longctx_cli.parallel.sharding import IGNORE_INDEX, local_ranges
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state


def packed_row(lengths: list[int], seed: int = 0):
    """input_ids, position_ids and HF-style labels (-100 on each document's first token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX
    return ids, pos, labels


def shard_all(lengths: list[int], sp: int, layout: str):
    ids, pos, labels = packed_row(lengths)
    ctxs = [rank_state(sp_rank=r, sp_size=sp, layout=layout) for r in range(sp)]
    return (ids, pos, labels), [shard_batch(ids, pos, labels, c, pad_token_id=1) for c in ctxs]


def reassemble(batches, field: str) -> torch.Tensor:
    """Put every rank's slice back at its global positions."""
    total = batches[0].sp_meta.total_len
    full = torch.full((total,), -999, dtype=torch.long)
    for b in batches:
        local = getattr(b, field)[0]
        offset = 0
        for a, e in b.sp_meta.local_ranges:
            full[a:e] = local[offset : offset + e - a]
            offset += e - a
    return full


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_slices_cover_the_padded_row(sp: int, layout: str) -> None:
    lengths = [1, 9, 1, 20, 6]  # 37 tokens: never a multiple of 2*sp, so always padded
    (ids, pos, _), batches = shard_all(lengths, sp, layout)
    multiple = sp * (2 if layout == "zigzag" else 1)
    total = batches[0].sp_meta.total_len
    assert total % multiple == 0 and total - 37 == -37 % multiple
    full_ids = reassemble(batches, "input_ids")
    full_pos = reassemble(batches, "position_ids")
    assert torch.equal(full_ids[:37], ids) and bool((full_ids[37:] == 1).all())
    assert torch.equal(full_pos[:37], pos)
    assert torch.equal(full_pos[37:], torch.arange(total - 37))  # tail is its own document
    for b in batches:
        assert b.input_ids.shape == (1, total // sp)


def test_cu_seqlens_count_one_token_docs_and_padding_tail() -> None:
    _, batches = shard_all([1, 9, 1, 20, 6], 2, "zigzag")  # 37 -> 40
    assert batches[0].sp_meta.cu_seqlens.tolist() == [0, 1, 10, 11, 31, 37, 40]
    _, batches = shard_all([4, 4], 2, "contiguous")  # no padding needed
    assert batches[1].sp_meta.cu_seqlens.tolist() == [0, 4, 8]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_labels_are_shifted_once_on_the_full_row(sp: int, layout: str) -> None:
    lengths = [5, 1, 12, 3, 11]
    (ids, pos, labels), batches = shard_all(lengths, sp, layout)
    shifted = reassemble(batches, "shift_labels")
    t = ids.numel()
    for i in range(t - 1):
        want = IGNORE_INDEX if pos[i + 1] == 0 else int(ids[i + 1])
        assert int(shifted[i]) == want, i
    assert bool((shifted[t - 1 :] == IGNORE_INDEX).all())  # row end and padding
    # Every target of the unsharded shift survives sharding: none lost at rank boundaries.
    assert int((shifted != IGNORE_INDEX).sum()) == t - len(lengths)


def test_zigzag_owns_chunks_r_and_2n_minus_1_minus_r() -> None:
    assert local_ranges(16, rank_state(sp_rank=0, sp_size=4, layout="zigzag")) == ((0, 2), (14, 16))
    assert local_ranges(16, rank_state(sp_rank=2, sp_size=4, layout="zigzag")) == ((4, 6), (10, 12))
    assert local_ranges(16, rank_state(sp_rank=3, sp_size=4)) == ((12, 16),)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_segments_cover_each_local_query_once(layout: str) -> None:
    lengths = [3, 14, 1, 1, 9, 4]
    _, batches = shard_all(lengths, 4, layout)
    full_pos = reassemble(batches, "position_ids")
    for b in batches:
        meta = b.sp_meta
        covered = torch.zeros(meta.local_len, dtype=torch.long)
        for seg in meta.segments:
            covered[seg.q_start : seg.q_end] += 1
            # keys start at the document start; the last key is the last query's own token
            assert full_pos[seg.k_start] == 0
            assert seg.k_end - seg.k_start >= seg.q_end - seg.q_start
        assert bool((covered == 1).all())


def test_single_process_groups_without_distributed() -> None:
    ctx = sp_state(sp=1, kernel="auto")
    assert ctx.mesh is None and ctx.sp_group is None and ctx.replica_group is None
    assert (ctx.sp_rank, ctx.layout.sp, ctx.layout.kernel) == (0, 1, "torch")
    with pytest.raises(ValueError):
        sp_state(sp=2, world=2)


def mesh_worker(rank: int, world_size: int) -> dict:
    ranks = dist.get_process_group_ranks
    ctx = sp_state(sp=2, kernel="torch")
    dp_group = ctx.mesh["dp_replicate"].get_group()
    one = sp_state(sp=1, kernel="torch")
    hyb = sp_state(sp=4, mode="hybrid", ulysses_degree=2, kernel="torch")
    return {
        "sp": ranks(ctx.sp_group),
        "dp": ranks(dp_group),
        "sp_rank": ctx.sp_rank,
        "sp1": (one.sp_group, one.layout.sp),
        "ulysses": ranks(hyb.ulysses_group),
        "ring": ranks(hyb.ring_group),
    }


def test_dp_major_rank_layout() -> None:
    results = run_distributed(mesh_worker, 4, timeout_s=60)
    for rank, res in enumerate(results):
        base = rank // 2 * 2
        assert res["sp"] == [base, base + 1] and res["sp_rank"] == rank % 2
        assert res["dp"] == [rank % 2, rank % 2 + 2]
        assert res["sp1"] == (None, 1)
        u = rank // 2 * 2
        assert res["ulysses"] == [u, u + 1]
        assert res["ring"] == [rank % 2, rank % 2 + 2]

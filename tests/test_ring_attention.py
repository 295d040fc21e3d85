"""Ring attention (torch kernel) at sp=2 and sp=4 equals single-process attention, exactly.

Every case compares the gathered output and dq/dk/dv with the dense per-document causal
reference of `tests/attention_cases.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx_cli.parallel import SPContext, build_parallel_groups, single_process_context
from tests.attention_cases import CASES, DIM, TOL, assert_all_close, rel_err, run_case
from tests.distributed import run_distributed


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

"""Gradients are summed over the replica group in buckets (train/step.py): each bucket holds
one dtype and at most the byte limit, a larger gradient is summed alone in place, and the sums
equal each gradient's own sum over the ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.train.step import gradient_buckets, sum_gradients
from tests.distributed import run_distributed

# Gradient sizes in elements: float32 (4 bytes each) except the one float64.
SIZES = [(100, torch.float32), (300, torch.float32), (50, torch.float64), (1000, torch.float32),
         (10, torch.float32), (200, torch.float64), (20, torch.float32)]
LIMIT = 1600  # bytes: 400 float32 elements


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for n, dtype in SIZES:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = torch.randn(n, generator=g, dtype=dtype)
        params.append(p)
    params.insert(2, torch.nn.Parameter(torch.zeros(3)))  # no gradient: left out
    return params


def test_buckets_keep_order_dtype_and_limit():
    params = _params(0)
    buckets = gradient_buckets(params, LIMIT)
    grads = [p.grad for p in params if p.grad is not None]
    flat = [g for b in buckets for g in b]
    assert sorted(map(id, flat)) == sorted(map(id, grads))  # every gradient, once
    for bucket in buckets:
        assert len({g.dtype for g in bucket}) == 1
        size = sum(g.numel() * g.element_size() for g in bucket)
        assert size <= LIMIT or len(bucket) == 1  # only a lone gradient may exceed it
        order = [next(i for i, x in enumerate(grads) if x is g) for g in bucket]
        assert order == sorted(order)
    assert [len(b) for b in buckets if b[0].dtype == torch.float32] == [2, 1, 2]
    assert [[g.numel() for g in b] for b in buckets if b[0].dtype == torch.float64] == [[50], [200]]


def _sum_worker(rank: int, world: int) -> list[list[float]]:
    params = _params(rank)
    # small buckets, so every case occurs: shared, lone and over the limit
    sum_gradients(params, ParallelState(replica_group=dist.group.WORLD), LIMIT)
    return [p.grad.tolist() for p in params if p.grad is not None]


def test_bucketed_sum_equals_each_gradients_sum():
    out = run_distributed(_sum_worker, 2, timeout_s=120)
    assert out[0] == out[1]
    expected = [a.grad + b.grad for a, b in zip(_params(0), _params(1), strict=True)
                if a.grad is not None]
    for got, want in zip(out[0], expected, strict=True):
        torch.testing.assert_close(torch.tensor(got, dtype=want.dtype), want, rtol=0, atol=0)

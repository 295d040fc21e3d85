"""Attention stays exact to half precision under fp16/bf16 autocast, for every strategy:
scores, softmax statistics and accumulation are float32 inside the kernels whatever
autocast says (an enclosing autocast would otherwise run the tiled path's float32 score
matmuls in half precision)."""

from __future__ import annotations

import pytest
import torch

from tests.attention_cases import CASES, run_case
from tests.distributed import run_distributed
from tests.layouts import sp_state

# (mode, sharding, ring_attn_func, ulysses degree) at sp = 4
STRATEGIES = {
    "ring": ("ring", "contiguous", "varlen_llama3", None),
    "ring_zigzag": ("ring", "zigzag", "varlen_llama3", None),
    "ulysses": ("ulysses", "contiguous", "varlen_llama3", None),
    "hybrid": ("hybrid", "zigzag", "varlen_llama3", 2),
    "batch_ring": ("ring", "contiguous", "batch_ring", None),
    "batch_zigzag": ("ring", "zigzag", "batch_zigzag", None),
    "batch_stripe": ("ring", "stripe", "batch_stripe", None),
}
# Relative error of out / dq / dk / dv against float64 on the same rounded inputs: the
# outputs' own rounding (bf16 ~4e-3, fp16 ~5e-4) plus float32 accumulation, with margin.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Softcapped layers take the tiled matmul path (whose score tiles autocast used to round);
# plain layers the CPU flash op. Scores of a few tens make any rounding in them visible.
FEATURES = {"softcap": (None, 30.0), "window": (9, None)}
Q_SCALE = 6.0


def half_worker(rank: int, world: int, dtype_name: str) -> dict[str, dict]:
    dtype = getattr(torch, dtype_name)
    errors = {}
    for name, (mode, sharding, func, u) in STRATEGIES.items():
        ctx = sp_state(sp=world, mode=mode, layout=sharding, ring_attn_func=func,
                       ulysses_degree=u, kernel="torch")
        for feature, (window, softcap) in FEATURES.items():
            lengths, hq, hkv = CASES["gqa_8q_4kv"]
            errors[f"{name}/{feature}"] = run_case(ctx, lengths, hq, hkv, 7, window, softcap,
                                                   autocast=dtype, q_scale=Q_SCALE)
    return errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_strategy_is_exact_to_half_precision_under_autocast(dtype: torch.dtype) -> None:
    errors = run_distributed(half_worker, 4, str(dtype).split(".")[-1], timeout_s=240)[0]
    bad = {case: e for case, e in errors.items() if max(e.values()) >= TOL[dtype]}
    assert not bad, f"relative errors >= {TOL[dtype]}: {bad}"

"""Llama 4's chunked local attention and multi-head latent attention's value head dim
(DeepSeek V3) in every SP strategy and kernel, against the dense reference of
``tests/attention_cases.py`` (float64, its own chunk mask: equal ``position // chunk`` inside
one document).

Chunks of 8 tokens counted from each document's start (the documents start off multiples of
8, so chunks counted from the row start would differ), crossing rank boundaries, with a
window and sinks on top; values of 8 and 24 dims against q/k of 16 (narrower and wider than
q/k). Every strategy (llama3 ring contiguous and zigzag, the three P2P rings, Ulysses,
hybrid with both rings at sp=4) on the ``torch`` kernel; the ``torch_flash`` kernel on the
test stand-in of PyTorch's flash op (which, like the real op, takes one head dim for q, k and
v); the ``flash`` kernel through ring-flash-attn's own code on the flash-attn stand-in (which
checks the same). One run of 2 and one of 4 processes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from longctx_cli.layout import LayoutError
from longctx_cli.parallel import AttentionFeatures, ParallelState, shard_batch
from longctx_cli.parallel.sharding import chunk_bounds, chunked_meta
from longctx_cli.parallel.torch_flash import use_flash_ops
from tests import torch_flash_standin as standin
from tests.attention_cases import CASES, DIM, assert_all_close, run_case
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_flash_adapter import STANDIN

CHUNK = 8
# name -> (chunk, window, softcap, sinks, value head dim)
VARIANTS: dict[str, tuple[int | None, int | None, float | None, bool, int]] = {
    "chunk": (CHUNK, None, None, False, DIM),
    "chunk+window5+sinks": (CHUNK, 5, None, True, DIM),
    "mla_v8": (None, None, None, False, 8),
    "mla_v24+window5": (None, 5, None, False, 24),
    "mla_v8+chunk+sinks": (CHUNK, None, None, True, 8),
    "mla_v8+softcap": (None, None, 1.5, False, 8),
}
# The flash kernels run the variants they compute (softcap and sinks: see their tests).
FLASH_VARIANTS = ("chunk", "mla_v8", "mla_v24+window5", "mla_v8+chunk+sinks")
# Rows of every case kind at sp=2; at sp=4 those whose documents cross most rank boundaries.
ROWS = {2: ("causal", "packed_inside", "one_token_docs", "spans_all_ranks", "gqa_8q_2kv"),
        4: ("packed_inside", "spans_all_ranks", "gqa_8q_2kv")}


def _contexts(world_size: int) -> dict[str, dict]:
    """Strategy name -> sp_state arguments: every strategy at sp=2; at sp=4 hybrid (both
    rings) and one of each other kind (Ulysses replicates 2 KV heads to 4 ranks there)."""
    if world_size == 4:
        return {
            "hybrid": {"mode": "hybrid", "ulysses_degree": 2},
            "hybrid zigzag": {"mode": "hybrid", "ulysses_degree": 2, "layout": "zigzag"},
            "hybrid batch_ring": {"mode": "hybrid", "ulysses_degree": 2,
                                  "ring_attn_func": "batch_ring"},
            "ring": {"layout": "contiguous"},
            "batch_zigzag": {"ring_attn_func": "batch_zigzag"},
            "ulysses": {"mode": "ulysses"},
        }
    return {
        "ring": {"layout": "contiguous"},
        "ring zigzag": {"layout": "zigzag"},
        "batch_ring": {"ring_attn_func": "batch_ring"},
        "batch_zigzag": {"ring_attn_func": "batch_zigzag"},
        "batch_stripe": {"ring_attn_func": "batch_stripe"},
        "ulysses": {"mode": "ulysses"},
        "ulysses zigzag": {"mode": "ulysses", "layout": "zigzag"},
    }


def _runs(ctx: ParallelState, prefix: str, variants) -> dict[str, dict]:
    errors = {}
    for v in variants:
        chunk, window, softcap, sinks, v_dim = VARIANTS[v]
        for i, name in enumerate(ROWS[ctx.layout.sp]):
            lengths, hq, hkv = CASES[name]
            errors[f"{prefix}/{v}/{name}"] = run_case(
                ctx, lengths, hq, hkv, 300 + i, window, softcap, sinks, chunk=chunk,
                v_dim=v_dim)
    return errors


def worker(rank: int, world_size: int) -> dict:
    sys.path.insert(0, STANDIN)  # flash-attn's stand-in, this process only
    use_flash_ops(standin.OPS)  # PyTorch's flash op's stand-in, this process only
    errors: dict[str, dict] = {}
    kernels_run = []
    for name, args in _contexts(world_size).items():
        ctx = sp_state(sp=world_size, kernel="torch", **args)
        errors.update(_runs(ctx, f"{name}/torch", VARIANTS))
        errors.update(_runs(ctx.with_layout(kernel="torch_flash"), f"{name}/torch_flash",
                            FLASH_VARIANTS))
        try:
            flash = ctx.with_layout(kernel="flash")
        except LayoutError:  # a sharding ring-flash-attn does not compute
            continue
        errors.update(_runs(flash, f"{name}/flash", [
            v for v in FLASH_VARIANTS if not VARIANTS[v][3]]))  # flash-attn has no sinks
        kernels_run.append(name)
    return {"errors": errors, "flash": kernels_run,
            "standin_calls": dict(standin.CALLS),
            "flash_attn_loaded": "flash_attn.flash_attn_interface" in sys.modules}


@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_and_latent_attention_in_every_strategy_and_kernel(sp: int) -> None:
    for result in run_distributed(worker, sp, timeout_s=300):
        assert_all_close(result["errors"])
        assert result["flash_attn_loaded"]  # ring-flash-attn ran on the stand-in
        assert {"ring", "ulysses"} <= set(result["flash"]), result["flash"]
        assert result["standin_calls"]["forward"] > 0 and result["standin_calls"]["backward"] > 0
        assert len(result["errors"]) >= len(_contexts(sp)) * len(ROWS[sp]) * (
            len(VARIANTS) + len(FLASH_VARIANTS))


def test_chunks_count_from_each_document_start() -> None:
    # Documents of 10, 3 and 20 tokens (starting at 0, 10, 13) and a padding tail of 3.
    assert chunk_bounds((0, 10, 13, 33, 36), 8) == (0, 8, 10, 13, 21, 29, 33, 36)
    assert chunk_bounds((0, 10, 13, 33, 36), 64) == (0, 10, 13, 33, 36)
    pos = torch.cat([torch.arange(n) for n in (10, 3, 20)])
    meta = shard_batch(pos, pos, pos, ParallelState()).sp_meta
    chunked = chunked_meta(meta, 8)
    assert chunked.cu_host == (0, 8, 10, 13, 21, 29, 33)
    assert chunked_meta(meta, 8) is chunked  # built once per row, shared by every layer
    assert chunked_meta(meta, 64) is meta  # no document longer than a chunk: the row itself
    assert meta.cu_host == (0, 10, 13, 33)  # documents (and so labels) are untouched


def test_a_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk"):
        AttentionFeatures(scale=1.0, chunk=0)

"""The flash kernel adapter runs ring-flash-attn's real llama3 code and equals the torch kernel.

flash-attn itself needs a GPU, so the workers put a test-only stand-in for its kernel entry
points (``tests/flash_attn_standin``, plain PyTorch) on ``sys.path``. Everything between our
metadata and those kernels - ``llama3_flash_attn_prepare_cu_seqlens``, ``local_k_slice``,
the head-stride loop, all-gather and reduce-scatter - is ring-flash-attn's own code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from longctx_cli.parallel import gather_sequence, slice_sequence, sp_attention
from tests.attention_cases import (
    CASES,
    FEATURE_CASES,
    FEATURES,
    make_inputs,
    rel_err,
    run_case,
)
from tests.distributed import run_distributed
from tests.layouts import sp_state

STANDIN = str(Path(__file__).parent / "flash_attn_standin")
TOL = 1e-5


def attention_and_grads(ctx, q, k, v, dout, meta) -> list[torch.Tensor]:
    local = [slice_sequence(x, ctx).clone().requires_grad_() for x in (q, k, v)]
    out = sp_attention(*local, meta, q.shape[-1] ** -0.5)
    out.backward(slice_sequence(dout, ctx))
    return [gather_sequence(x, ctx) for x in (out.detach(), *(t.grad for t in local))]


def flash_worker(rank: int, world_size: int) -> dict[str, float]:
    sys.path.insert(0, STANDIN)  # this process only
    from longctx_cli.parallel import shard_batch
    from longctx_cli.parallel.ring_flash import load_ring_flash_attn

    load_ring_flash_attn()  # fails here, not silently later, if the import path breaks
    torch_ctx = sp_state(sp=world_size, layout="contiguous", kernel="torch")
    flash_ctx = torch_ctx.with_layout(kernel="flash")
    errors = {}
    for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
        for stride in [s for s in range(1, hkv + 1) if hkv % s == 0]:
            pos, _, q, k, v, dout = make_inputs(lengths, hq, hkv, world_size, seed=i)
            ids = torch.zeros_like(pos)
            results = []
            for ctx in (torch_ctx, flash_ctx):
                ctx = ctx.with_layout(heads_k_stride=stride)
                meta = shard_batch(ids, pos, ids, ctx).sp_meta
                results.append(attention_and_grads(ctx, q, k, v, dout, meta))
            for what, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
                errors[f"{name}/stride{stride}/{what}"] = rel_err(b, a)
    errors["loaded_module"] = float("flash_attn.flash_attn_interface" in sys.modules)
    return errors


@pytest.mark.parametrize("sp", [2, 4])
def test_flash_adapter_matches_torch_kernel(sp: int) -> None:
    for errors in run_distributed(flash_worker, sp, timeout_s=180):
        assert errors.pop("loaded_module") == 1.0  # the stand-in, i.e. ring_flash_attn ran
        bad = {k: e for k, e in errors.items() if not e < TOL}
        assert not bad, bad


def _refusal(ctx, window, softcap, sinks) -> str:
    """The error message of one refused feature combination ('' if it ran)."""
    try:
        run_case(ctx, [30, 34], 4, 2, 0, window, softcap, sinks)
    except NotImplementedError as err:
        return str(err)
    return ""


def flash_features_worker(rank: int, world_size: int) -> dict:
    """The flash kernel against the dense reference: what it supports is exact, the rest refused.

    Ring (ring-flash-attn's llama3 code): sliding windows. Ulysses (flash-attn varlen on the
    whole row): windows and softcap. Sinks: refused by both; softcap refused by the ring.
    """
    sys.path.insert(0, STANDIN)
    errors: dict = {}
    supported = {"ring": ("plain", "window5", "window40"), "ulysses": ("plain", "window5",
                 "window40", "softcap")}
    for mode, names in supported.items():
        ctx = sp_state(sp=world_size, mode=mode, layout="contiguous",
                                       kernel="flash")
        for f in names:
            window, softcap, sinks = FEATURES[f]
            for i, case in enumerate(FEATURE_CASES):
                lengths, hq, hkv = CASES[case]
                errors[f"{mode}/{f}/{case}"] = run_case(
                    ctx, lengths, hq, hkv, 300 + i, window, softcap, sinks
                )
    chunked = sp_state(sp=world_size, mode="ulysses", layout="contiguous", kernel="flash",
                       head_chunks=2)
    for f in supported["ulysses"]:  # flash-attn's Ulysses one head chunk at a time
        window, softcap, sinks = FEATURES[f]
        for i, case in enumerate(FEATURE_CASES):
            lengths, hq, hkv = CASES[case]
            errors[f"ulysses/chunked/{f}/{case}"] = run_case(
                chunked, lengths, hq, hkv, 300 + i, window, softcap, sinks
            )
    ring = sp_state(sp=world_size, layout="contiguous", kernel="flash")
    uly = sp_state(sp=world_size, mode="ulysses", kernel="flash")
    refused = {
        "ring/softcap": _refusal(ring, None, 1.5, False),
        "ring/sinks": _refusal(ring, None, None, True),
        "ulysses/sinks": _refusal(uly, 4, None, True),
    }
    return {"errors": errors, "refused": refused}


def test_flash_kernel_features_exact_or_refused() -> None:
    for result in run_distributed(flash_features_worker, 2, timeout_s=180):
        bad = {k: e for k, e in result["errors"].items() if not max(e.values()) < TOL}
        assert not bad, bad
        assert len(result["errors"]) == 11 * len(FEATURE_CASES)
        refused = result["refused"]
        assert "softcap" in refused["ring/softcap"] and "ulysses" in refused["ring/softcap"]
        assert "sinks" in refused["ring/sinks"] and "sinks" in refused["ulysses/sinks"]


def test_standin_is_not_visible_outside_the_workers() -> None:
    assert STANDIN not in sys.path

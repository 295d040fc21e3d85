"""The P2P ring's flash kernel: ring-flash-attn's own P2P functions, on the test stand-in.

flash-attn needs a GPU; the workers put `tests/flash_attn_standin` (plain PyTorch kernels
with flash-attn 2.7's entry points) on ``sys.path`` so that ring-flash-attn's real
``ring_flash_attn_func`` / ``zigzag_ring_flash_attn_func`` / ``stripe_flash_attn_func``
run on CPU. flash-attn computes in bf16/fp16 only, so a one-document bf16 row is compared
with the torch P2P kernel on the same bf16 inputs (bf16 tolerance); packed rows, windows,
softcap, sinks and float32 fall back to the torch kernel, exactly, with a warning.
"""

from __future__ import annotations

import logging
import sys

import torch

from longctx_cli.layout import P2P_SHARDING
from longctx_cli.parallel import shard_batch, slice_sequence, sp_attention
from tests.attention_cases import CASES, assert_all_close, make_inputs, rel_err, run_case
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_flash_adapter import STANDIN

BF16_TOL = 2e-2


def _grads(ctx, q, k, v, dout, pos) -> list[torch.Tensor]:
    meta = shard_batch(torch.zeros_like(pos), pos, torch.zeros_like(pos), ctx).sp_meta
    local = [slice_sequence(x, ctx).clone().requires_grad_() for x in (q, k, v)]
    out = sp_attention(*local, meta, q.shape[-1] ** -0.5)
    out.backward(slice_sequence(dout, ctx))
    return [out.detach().float(), *(t.grad.float() for t in local)]


def p2p_flash_worker(rank: int, world_size: int) -> dict:
    sys.path.insert(0, STANDIN)  # this process only
    import longctx_cli.parallel.ring_flash as ring_flash

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("longctx_cli.parallel.ring_p2p").addHandler(Keep())
    calls = {"n": 0}
    real = ring_flash.flash_p2p_attention

    def counted(*args, **kwargs):  # counts, then runs ring-flash-attn's real code
        calls["n"] += 1
        return real(*args, **kwargs)

    ring_flash.flash_p2p_attention = counted
    bf16: dict = {}
    exact: dict = {}
    for func, layout in P2P_SHARDING.items():
        ctx = sp_state(
            sp=world_size, layout=layout, ring_attn_func=func, kernel="torch"
        )
        flash = ctx.with_layout(kernel="flash")
        for hq, hkv in ((4, 4), (8, 2)):  # one document, MHA and GQA
            multiple = world_size * (2 if layout == "zigzag" else 1)
            pos, _, *tensors = make_inputs([64], hq, hkv, multiple, seed=hq)
            tensors = [t.bfloat16() for t in tensors]
            before = calls["n"]
            got = _grads(flash, *tensors, pos)
            assert calls["n"] == before + 1, "ring-flash-attn did not run"
            want = _grads(ctx, *tensors, pos)
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                bf16[f"{func}/{hq}x{hkv}/{what}"] = rel_err(a, b)
        before = calls["n"]
        lengths, hq, hkv = CASES["packed_inside"]
        exact[f"{func}/packed"] = run_case(flash, lengths, hq, hkv, 2)
        exact[f"{func}/window"] = run_case(flash, [64], 4, 4, 3, window=5)
        exact[f"{func}/sinks_softcap"] = run_case(flash, [64], 4, 4, 4, None, 1.5, True)
        exact[f"{func}/float32"] = run_case(flash, [64], 4, 4, 5)
        assert calls["n"] == before, "a row ring-flash-attn cannot compute reached it"
    return {"bf16": bf16, "exact": exact, "warnings": warnings}


def test_p2p_flash_matches_torch_kernel_or_falls_back_exactly() -> None:
    for result in run_distributed(p2p_flash_worker, 2, timeout_s=180):
        bad = {k: e for k, e in result["bf16"].items() if not e < BF16_TOL}
        assert not bad, bad
        assert_all_close(result["exact"])
        text = " ".join(result["warnings"])
        for why in ("documents", "sliding window", "softcap", "float32"):
            assert why in text, text
    assert STANDIN not in sys.path

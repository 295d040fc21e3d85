"""The ``cudnn`` kernel (PyTorch's cuDNN attention ops) on CPU, through a stand-in; and the
``cudnn`` and ``fa4`` kernels under every strategy at sp 2, multi-process on gloo.

The CUDA ops cannot run here, so ``tests/cudnn_standin.py`` implements their contract (read
from PyTorch's source, cited there) and the kernel is pointed at it with ``use_cudnn_ops``.
The stand-in is checked against SDPA in float64 (top-left causal, GQA, the log-sum-exp's
layouts and natural-log units); a split of the keys into two op calls merged by the
log-sum-exp reproduces full attention with exact gradients; and the kernel under ring,
Ulysses and hybrid equals the dense float64 reference of ``tests/attention_cases.py``.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from longctx_cli.parallel.cudnn_attention import (
    _plan,
    cudnn_ops,
    use_cudnn_ops,
    use_ragged_backward,
)
from longctx_cli.parallel.cudnn_attention import block_backward as cudnn_block_backward
from longctx_cli.parallel.cudnn_attention import block_forward as cudnn_block_forward
from longctx_cli.parallel.fa4_attention import ops_for, use_fa4_ops
from longctx_cli.parallel.torch_flash import use_flash_ops
from longctx_cli.parallel.torch_kernel import (
    AttentionFeatures,
    Segment,
    doc_causal_attention,
    doc_causal_backward,
    doc_causal_forward,
)
from tests import cudnn_standin as standin
from tests import fa4_standin
from tests import torch_flash_standin as flash_standin
from tests.attention_cases import CASES, TOL, assert_all_close, feature_runs, rel_err, run_case
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state


@pytest.fixture
def cudnn_calls():
    """The cuDNN ops' stand-in, and the flash op's (one-row blocks go there)."""
    previous, flash = use_cudnn_ops(standin.OPS), use_flash_ops(flash_standin.OPS)
    yield standin.CALLS
    use_cudnn_ops(previous)
    use_flash_ops(flash)


@pytest.fixture(params=["HT", "TH1"])
def lse_layout(request):
    """Both ragged log-sum-exp layouts PyTorch has shipped."""
    before = standin.LSE_LAYOUT["ragged"]
    standin.LSE_LAYOUT["ragged"] = request.param
    yield request.param
    standin.LSE_LAYOUT["ragged"] = before


def sdpa64(q, k, v, causal, scale):
    """``[L, H, D]`` float64 SDPA (top-left ``is_causal``), and the natural-log lse."""
    groups = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k.repeat_interleave(groups, 1),
                                             v.repeat_interleave(groups, 1)))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return out.transpose(0, 1), torch.logsumexp(s, -1)


# ---- the stand-in against SDPA -------------------------------------------------------------


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_standin_matches_sdpa(hq: int, hkv: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(hq + causal)
    lq, lk = (9, 9) if causal else (6, 11)
    q = torch.randn(lq, hq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(lk, hkv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(lq, hq, 16, generator=g, dtype=torch.float64)
    view = lambda x: x.transpose(0, 1)[None]  # noqa: E731 - [L, H, D] as [1, H, L, D]
    out, lse, cq, ck, mq, mk, seed, offset, _ = standin.dense_forward(
        view(q), view(k), view(v), None, True, 0.0, causal, False, scale=0.3)
    assert lse.shape == (1, hq, lq, 1) and lse.dtype == torch.float32  # [B, H, S, 1]
    assert cq is None and ck is None and (mq, mk) == (lq, lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = sdpa64(*leaves, causal, 0.3)
    assert rel_err(out[0].transpose(0, 1), ref.detach()) < 1e-12
    assert rel_err(lse[0, :, :, 0], ref_lse.detach()) < 1e-6  # natural log, not log2
    ref.backward(dout)
    grads = standin.dense_backward(view(dout), view(q), view(k), view(v), out, lse, seed,
                                   offset, None, None, None, lq, lk, 0.0, causal, scale=0.3)
    for got, leaf in zip(grads, leaves, strict=True):
        assert rel_err(got[0].transpose(0, 1), leaf.grad) < 1e-6


def test_ragged_standin_matches_sdpa_per_sequence(lse_layout: str) -> None:
    g = torch.Generator().manual_seed(5)
    lengths = [5, 12, 2, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = sum(lengths)
    q = torch.randn(t, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(t, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(t, 8, 16, generator=g, dtype=torch.float64)
    out, lse, *rest = standin.ragged_forward(q, k, v, None, cu, cu, 12, 12, True, 0.0, True,
                                             False, scale=0.25)
    assert lse.shape == ((8, t) if lse_layout == "HT" else (t, 8, 1))
    lse_ht = lse if lse_layout == "HT" else lse[..., 0].T
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    bounds = cu.tolist()
    refs = [sdpa64(*(x[a:b] for x in leaves), True, 0.25) for a, b in pairwise(bounds)]
    ref = torch.cat([o for o, _ in refs])
    assert rel_err(out, ref.detach()) < 1e-12
    assert rel_err(lse_ht, torch.cat([lo for _, lo in refs], 1).detach()) < 1e-6
    ref.backward(dout)
    grads = standin.ragged_backward(dout, q, k, v, out, lse, rest[4], rest[5], None, cu, cu,
                                    12, 12, 0.0, True, scale=0.25)
    for got, leaf in zip(grads, leaves, strict=True):
        assert rel_err(got, leaf.grad) < 1e-6


def test_two_blocks_merged_by_lse_reproduce_full_attention() -> None:
    """Rows that are the tail of their keys: the keys before the diagonal (no mask) and the
    diagonal square (causal) as two op calls, merged through the log-sum-exp, equal full
    bottom-right causal attention in float64; each call's backward with the merged out/lse
    gives the exact gradients."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(6, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(15, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(6, 4, 8, generator=g, dtype=torch.float64)
    view = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    parts = []
    for keys, causal in ((slice(0, 9), False), (slice(9, 15), True)):
        o, lse, *_ = standin.dense_forward(view(q), view(k[keys]), view(v[keys]), None, True,
                                           0.0, causal, False, scale=0.4)
        parts.append((keys, causal, o[0].transpose(0, 1), lse[0, :, :, 0].double()))
    lse = torch.logaddexp(parts[0][3], parts[1][3])
    out = sum(o * torch.exp(lo - lse).T[..., None] for _, _, o, lo in parts)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    lse4 = lse.float()[None, ..., None]
    for keys, causal, _, _ in parts:
        a, b, c = standin.dense_backward(view(dout), view(q), view(k[keys]), view(v[keys]),
                                         view(out), lse4, None, None, None, None, None, 6,
                                         keys.stop - keys.start, 0.0, causal, scale=0.4)
        dq += a[0].transpose(0, 1)
        dk[keys] += b[0].transpose(0, 1)
        dv[keys] += c[0].transpose(0, 1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    keep = torch.arange(15)[None, :] <= torch.arange(6)[:, None] + 9  # bottom-right
    qh, kh, vh = (x.transpose(0, 1) for x in (leaves[0], *(y.repeat_interleave(2, 1)
                                                            for y in leaves[1:])))
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=0.4).transpose(0, 1)
    assert rel_err(out, ref.detach()) < 1e-6
    ref.backward(dout)
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert rel_err(got, leaf.grad) < 1e-6


# ---- the kernel's split and one process ----------------------------------------------------


def test_plan_cuts_segments_into_squares_and_keys_before_them() -> None:
    # A contiguous shard: a document begun on an earlier rank (2 rows, keys 0..10), one of 14.
    plan = _plan((Segment(0, 2, 0, 10), Segment(2, 16, 10, 24)))
    (diag,) = plan.diagonal
    assert diag.causal and (diag.q0, diag.q1, diag.k0, diag.k1) == (0, 16, 8, 24)
    assert diag.cu_q == diag.cu_k == (0, 2, 16)  # squares: top-left = bottom-right
    (before,) = plan.before
    assert not before.causal and (before.q0, before.q1, before.k0, before.k1) == (0, 2, 0, 8)
    # One-token documents never reach the ops (key length 1): computed directly.
    plan = _plan((Segment(0, 1, 0, 1), Segment(1, 5, 1, 5)))
    assert [type(p).__name__ for p in plan.diagonal] == ["_Single", "_Batch"]


def test_the_real_ops_are_the_default_and_refuse_cpu_tensors() -> None:
    ops = cudnn_ops()
    assert ops.dense_forward is torch.ops.aten._scaled_dot_product_cudnn_attention
    assert ops.ragged_backward is torch.ops.aten._cudnn_attention_backward
    assert not ops.supports(torch.zeros(4, 2, 16, dtype=torch.bfloat16))


def test_single_process_matches_reference(cudnn_calls) -> None:
    """With the ragged backward op switched on, and the older ragged log-sum-exp layout
    ([T, H, 1]); the multi-process test below runs the defaults (the current [H, T], packed
    rows' backward per document on the dense op)."""
    standin.LSE_LAYOUT["ragged"] = "TH1"
    was = use_ragged_backward(True)
    try:
        ctx = rank_state(layout="contiguous", kernel="cudnn")
        before = dict(cudnn_calls)
        for i, (lengths, hq, hkv) in enumerate(CASES.values()):
            errors = run_case(ctx, lengths, hq, hkv, seed=100 + i)
            assert max(errors.values()) < TOL, errors
    finally:
        standin.LSE_LAYOUT["ragged"] = "HT"
        use_ragged_backward(was)
    used = {k: cudnn_calls[k] - before[k] for k in before}
    # Packed rows take the ragged op, one-document rows the dense one; backward likewise.
    assert all(n > 0 for n in used.values()), used


def test_window_and_softcap_do_not_reach_the_cudnn_ops(cudnn_calls) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 4, 16, generator=g) for _ in range(3))
    cu = [0, 12, 32]
    for feats in (AttentionFeatures(0.25, window=5), AttentionFeatures(0.25, softcap=2.0)):
        before = sum(cudnn_calls.values())
        got = doc_causal_attention(q, k, v, cu, feats, kernel="cudnn")
        assert sum(cudnn_calls.values()) == before
        assert rel_err(got, doc_causal_attention(q, k, v, cu, feats)) < TOL


def test_block_functions_match_the_torch_kernel(cudnn_calls) -> None:
    """What a P2P ring calls: one K,V block whose rows are the tail of their keys."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(8, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(24, 2, 16, generator=g) for _ in range(2))
    segs = (Segment(0, 3, 0, 10), Segment(3, 8, 10, 24))
    results = []
    for kernel in ("torch", "cudnn"):
        out, lse = doc_causal_forward(q, k, v, segs, 0.25, kernel=kernel)
        grads = doc_causal_backward(dout, q, k, v, out, lse, segs, 0.25, kernel=kernel)
        results.append((out, lse, *grads))
    for a, b in zip(*results, strict=True):
        assert rel_err(b, a) < TOL


def test_branch_documents_see_their_shared_prefix(cudnn_calls) -> None:
    """Shared pair prompts (`prefix_sharing`): a branch's rows also see the prompt's keys, a
    block with no mask on the cuDNN ops, merged through the log-sum-exp."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(24, 4, 16, generator=g).requires_grad_()
               for _ in range(3))
    cu, prefixes = [0, 10, 16, 24], ((10, 0, 10), (16, 0, 10))
    grads = []
    before = dict(cudnn_calls)
    for kernel in ("torch", "cudnn"):
        out = doc_causal_attention(q, k, v, cu, 0.25, kernel=kernel, prefixes=prefixes)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert cudnn_calls["dense_forward"] > before["dense_forward"]  # the prefix blocks
    assert cudnn_calls["ragged_forward"] > before["ragged_forward"]  # the three documents
    assert cudnn_calls["ragged_backward"] == before["ragged_backward"]  # off by default
    for a, b in zip(*grads, strict=True):
        assert rel_err(b, a) < TOL


def test_one_row_blocks_take_the_flash_op(cudnn_calls) -> None:
    """One query row is cuDNN's decode shape (refused by some cuDNN builds on Blackwell):
    such a block runs on PyTorch's flash op, and is exact."""
    g = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(1, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(10, 2, 16, generator=g) for _ in range(2))
    feats = AttentionFeatures(0.3)
    dense, flash = cudnn_calls["dense_forward"], flash_standin.CALLS["forward"]
    out, lse = cudnn_block_forward(q, k, v, False, feats)
    grads = cudnn_block_backward(dout, q, k, v, out, lse, False, feats)
    assert cudnn_calls["dense_forward"] == dense and flash_standin.CALLS["forward"] == flash + 1
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = sdpa64(*leaves, False, 0.3)
    assert rel_err(out, ref.detach()) < TOL and rel_err(lse, ref_lse.detach()) < TOL
    ref.backward(dout.double())
    for got, leaf in zip(grads, leaves, strict=True):
        assert rel_err(got, leaf.grad) < TOL


# ---- every strategy at sp 2, both new kernels, multi-process ------------------------------


def kernels_worker(rank: int, world_size: int) -> dict:
    use_cudnn_ops(standin.OPS)  # this process only
    use_flash_ops(flash_standin.OPS)
    use_fa4_ops(ops_for(fa4_standin.MODULE, supports=lambda q: True, name="fa4 stand-in"))
    errors: dict[str, dict] = {}
    setups = [("ring", None, "varlen_llama3", "contiguous"),
              ("ring", None, "varlen_llama3", "zigzag"),
              ("ring", None, "batch_zigzag", None),
              ("ulysses", None, "varlen_llama3", "zigzag"),
              ("hybrid", 1, "varlen_llama3", "contiguous"),
              ("hybrid", 2, "varlen_llama3", "zigzag")]
    for kernel in ("cudnn", "fa4"):
        for mode, u, func, layout in setups:
            ctx = sp_state(sp=world_size, mode=mode, ulysses_degree=u, layout=layout,
                           ring_attn_func=func, kernel=kernel)
            assert ctx.layout.kernel == kernel
            for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                errors[f"{kernel}/{mode}{u or ''}/{func}/{layout}/{name}"] = run_case(
                    ctx, lengths, hq, hkv, seed=i)
        errors.update(feature_runs(sp_state(sp=world_size, kernel=kernel), f"{kernel}/feat"))
    return {"errors": errors, "cudnn": dict(standin.CALLS), "fa4": dict(fa4_standin.CALLS)}


def test_cudnn_and_fa4_under_every_strategy_match_reference() -> None:
    for result in run_distributed(kernels_worker, 2, timeout_s=300):
        assert_all_close(result["errors"])
        assert len(result["errors"]) == 2 * (6 * len(CASES) + 6 * 4)
        calls = result["cudnn"]  # packed rows: ragged forward, dense backward per document
        assert calls["ragged_backward"] == 0, calls
        assert min(calls["ragged_forward"], calls["dense_forward"], calls["dense_backward"]) > 0
        assert result["fa4"]["forward"] > 0 and result["fa4"]["backward"] > 0

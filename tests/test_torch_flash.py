"""The ``torch_flash`` kernel (PyTorch's flash-attention op) on CPU, through a stand-in.

The CUDA op cannot run here, so ``tests/torch_flash_standin.py`` implements its varlen
contract in plain PyTorch and the kernel is pointed at it with ``use_flash_ops`` (the one
indirection the kernel looks the op up through). Two halves make the contract real:

* the stand-in itself equals dense attention written independently (SDPA with an explicit
  mask): bottom-right causal alignment, windows, GQA, the ``[H, total_q]`` log-sum-exp, and a
  backward that takes merged ``out``/``lse`` (what the LSE merge relies on);
* every strategy (ring, Ulysses, hybrid) and sharding (contiguous, zigzag) with the
  ``torch_flash`` kernel equals the dense float64 reference of ``tests/attention_cases.py``
  (rel err < 1e-5, the bar the CPU ``torch`` kernel passes on the same cases), multi-process
  on gloo, with every feature: windows and sinks through the op, softcap through the fallback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longctx_cli.kernel_choice import Platform, choose_kernel
from longctx_cli.layout import Layout, LayoutError
from longctx_cli.parallel.torch_flash import _runs, flash_ops, use_flash_ops
from longctx_cli.parallel.torch_kernel import (
    AttentionFeatures,
    Segment,
    doc_causal_attention,
    doc_causal_backward,
    doc_causal_forward,
)
from tests import torch_flash_standin as standin
from tests.attention_cases import (
    CASES,
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


@pytest.fixture
def standin_ops():
    previous = use_flash_ops(standin.OPS)
    yield standin.CALLS
    use_flash_ops(previous)


# ---- the stand-in against dense attention ------------------------------------------------


def dense_reference(q, k, v, lq_lk, scale, left, right):
    """Per sequence: SDPA with a boolean bottom-right (windowed) mask, float64, and its lse."""
    outs, lses = [], []
    qa = ka = 0
    groups = q.shape[1] // k.shape[1]
    for lq, lk in lq_lk:
        qs, ks, vs = q[qa : qa + lq], k[ka : ka + lk], v[ka : ka + lk]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        diag = i + lk - lq
        keep = (j <= diag + right) if right >= 0 else torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            keep = keep & (j >= diag - left)
        qh = qs.transpose(0, 1)
        kh = ks.repeat_interleave(groups, 1).transpose(0, 1)
        vh = vs.repeat_interleave(groups, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=scale)
                    .transpose(0, 1))
        scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        qa, ka = qa + lq, ka + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


SEQS = [(5, 5), (3, 9), (1, 4), (7, 7), (4, 12)]  # (Lq, Lk): square and query-tail sequences


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize(("left", "right"), [(-1, 0), (2, 0), (1, 0), (5, -1)])
def test_standin_matches_dense_attention(hq: int, hkv: int, left: int, right: int) -> None:
    g = torch.Generator().manual_seed(hq + 10 * left)
    tq, tk = sum(a for a, _ in SEQS), sum(b for _, b in SEQS)
    q = torch.randn(tq, hq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(tk, hkv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(tq, hq, 16, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in SEQS]).cumsum(0).tolist()],
                        dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in SEQS]).cumsum(0).tolist()],
                        dtype=torch.int32)
    causal = right == 0
    out, lse, rng, unused, _ = standin.flash_attention_forward(
        q, k, v, cu_q, cu_k, 7, 12, 0.0, causal, False, scale=0.3,
        window_size_left=left, window_size_right=None if causal else right,
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_reference(*leaves, SEQS, 0.3, left, right)
    assert lse.shape == (hq, tq) and lse.dtype == torch.float32
    assert rel_err(out, ref_out.detach()) < 1e-12 and rel_err(lse, ref_lse.detach()) < 1e-6
    ref_out.backward(dout)
    grads = standin.flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, 7, 12, 0.0, causal, rng, unused,
        scale=0.3, window_size_left=left, window_size_right=None if causal else right,
    )
    for got, leaf in zip(grads, leaves, strict=True):
        assert rel_err(got, leaf.grad) < 1e-6


def test_standin_backward_with_merged_lse_gives_exact_gradients() -> None:
    """Keys split in two ops, merged by lse, each backward run with the merged out/lse."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(10, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
    one = torch.tensor([0, 6], dtype=torch.int32)
    parts = []
    for keys, causal, cu_k in ((slice(0, 4), False, [0, 4]), (slice(4, 10), True, [0, 6])):
        cu = torch.tensor(cu_k, dtype=torch.int32)
        o, lse, *_ = standin.flash_attention_forward(
            q, k[keys], v[keys], one, cu, 6, cu_k[1], 0.0, causal, False, scale=0.5)
        parts.append((keys, causal, cu, o, lse))
    lse = torch.logaddexp(parts[0][4], parts[1][4])
    out = sum(o * torch.exp(lo - lse).T[..., None] for _, _, _, o, lo in parts)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for keys, causal, cu, _, _ in parts:
        a, b, c = standin.flash_attention_backward(
            dout, q, k[keys], v[keys], out, lse.contiguous(), one, cu, 6, cu[1].item(), 0.0,
            causal, torch.zeros(2), torch.empty(0), scale=0.5)
        dq += a
        dk[keys] += b
        dv[keys] += c
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = dense_reference(*leaves, [(6, 10)], 0.5, -1, 0)
    ref.backward(dout)
    assert rel_err(out, ref) < 1e-6
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert rel_err(got, leaf.grad) < 1e-6


# ---- the kernel's runs -------------------------------------------------------------------


def test_runs_pack_contiguous_keys_and_split_at_overlaps() -> None:
    # Contiguous shard: documents [0, 10), [10, 40) with rows 8..24 local: one run.
    contiguous = (Segment(0, 2, 0, 10), Segment(2, 16, 10, 24))
    (run,) = _runs(contiguous)
    assert (run.q0, run.q1, run.k0, run.k1) == (0, 16, 0, 24)
    assert run.cu_q == (0, 2, 16) and run.cu_k == (0, 10, 24) and run.max_k == 14
    # Zigzag: the second chunk's document started in the first chunk: a second run.
    zigzag = (Segment(0, 8, 0, 8), Segment(8, 16, 0, 64))
    assert [(r.q0, r.q1, r.k0, r.k1) for r in _runs(zigzag)] == [(0, 8, 0, 8), (8, 16, 0, 64)]
    # A gap between key ranges also starts a new run (no empty-query sequences are sent).
    gap = (Segment(0, 4, 0, 4), Segment(4, 8, 20, 24))
    assert len(_runs(gap)) == 2


def test_the_real_ops_are_the_default_and_refuse_cpu_tensors() -> None:
    ops = flash_ops()
    assert ops.forward is torch.ops.aten._flash_attention_forward
    assert not ops.supports(torch.zeros(4, 2, 16, dtype=torch.bfloat16))  # CPU: fallback


# ---- the kernel, single process ----------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_matches_reference(standin_ops, layout: str) -> None:
    ctx = rank_state(layout=layout, kernel="torch_flash")
    assert ctx.layout.kernel == "torch_flash"
    before = dict(standin_ops)
    for i, (lengths, hq, hkv) in enumerate(CASES.values()):
        errors = run_case(ctx, lengths, hq, hkv, seed=100 + i)
        assert max(errors.values()) < TOL, errors
    # One op call per row for every head at once (sp 1: no K/V to gather, so no head
    # groups), not per segment or head; zigzag's two chunks are two runs when a document
    # crosses between them.
    calls = len(CASES) * (1 if layout == "contiguous" else 2)
    assert calls // 2 < standin_ops["forward"] - before["forward"] <= calls
    assert standin_ops["backward"] - before["backward"] == standin_ops["forward"] - before[
        "forward"]
    assert_all_close(feature_runs(ctx, layout))


def test_softcap_takes_the_fallback_and_windows_the_op(standin_ops) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 4, 16, generator=g) for _ in range(3))
    cu = [0, 12, 32]
    before = standin_ops["forward"]
    capped = doc_causal_attention(q, k, v, cu, AttentionFeatures(0.25, softcap=2.0),
                                  kernel="torch_flash")
    assert standin_ops["forward"] == before
    windowed = doc_causal_attention(q, k, v, cu, AttentionFeatures(0.25, window=5),
                                    kernel="torch_flash")
    assert standin_ops["forward"] == before + 1
    for feats, got in ((AttentionFeatures(0.25, softcap=2.0), capped),
                       (AttentionFeatures(0.25, window=5), windowed)):
        assert rel_err(got, doc_causal_attention(q, k, v, cu, feats)) < TOL


def test_block_functions_take_the_kernel_argument(standin_ops) -> None:
    """What a strategy (e.g. a P2P ring) calls: forward/backward on one K,V block."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(8, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(24, 2, 16, generator=g) for _ in range(2))
    segs = (Segment(0, 3, 0, 10), Segment(3, 8, 10, 24))
    results = []
    for kernel in ("torch", "torch_flash"):
        out, lse = doc_causal_forward(q, k, v, segs, 0.25, kernel=kernel)
        grads = doc_causal_backward(dout, q, k, v, out, lse, segs, 0.25, kernel=kernel)
        results.append((out, lse, *grads))
    for a, b in zip(*results, strict=True):
        assert rel_err(b, a) < TOL


# ---- every strategy and sharding, multi-process --------------------------------------------


def flash_strategy_worker(rank: int, world_size: int) -> dict:
    use_flash_ops(standin.OPS)  # this process only
    errors: dict[str, dict] = {}
    setups = [("ring", None), ("ulysses", None)] + ([("hybrid", 2)] if world_size == 4 else [])
    for mode, u in setups:
        for layout in ("contiguous", "zigzag"):
            ctx = sp_state(sp=world_size, mode=mode, ulysses_degree=u,
                                           layout=layout, kernel="torch_flash")
            assert ctx.layout.kernel == "torch_flash"
            for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                strides = [s for s in range(1, hkv + 1) if hkv % s == 0] if mode == "ring" else [1]
                for stride in strides:
                    sub = ctx.with_layout(heads_k_stride=stride)
                    errors[f"{mode}/{layout}/{name}/stride{stride}"] = run_case(
                        sub, lengths, hq, hkv, seed=i)
            errors.update(feature_runs(ctx, f"{mode}/{layout}/features"))
    return {"errors": errors, "calls": dict(standin.CALLS)}


# sp 4 of the P2P rings stays by default in the test below.
@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_strategy_and_sharding_matches_reference(sp: int) -> None:
    for result in run_distributed(flash_strategy_worker, sp, timeout_s=300):
        assert_all_close(result["errors"])
        assert result["calls"]["forward"] > 0 and result["calls"]["backward"] > 0
        modes = 3 if sp == 4 else 2
        assert len(result["errors"]) >= modes * 2 * (len(CASES) + len(FEATURES) *
                                                      len(FEATURE_CASES))


def flash_p2p_worker(rank: int, world_size: int) -> dict:
    """The P2P rings' blocks on the op (through the stand-in): every case and feature."""
    use_flash_ops(standin.OPS)  # this process only
    errors: dict[str, dict] = {}
    calls: dict[str, int] = {}
    for func in ("batch_ring", "batch_zigzag", "batch_stripe"):
        ctx = sp_state(sp=world_size, ring_attn_func=func, kernel="torch_flash")
        before = standin.CALLS["forward"]
        for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
            errors[f"{func}/{name}"] = run_case(ctx, lengths, hq, hkv, seed=i)
        calls[func] = standin.CALLS["forward"] - before  # plain cases: no fallback
        errors.update(feature_runs(ctx, f"{func}/features"))
    return {"errors": errors, "calls": calls}


@pytest.mark.parametrize("sp", [2, 4])
def test_p2p_rings_run_their_blocks_on_the_flash_op(sp: int) -> None:
    for result in run_distributed(flash_p2p_worker, sp, timeout_s=300):
        assert_all_close(result["errors"])
        assert len(result["errors"]) == 3 * (len(CASES) + len(FEATURES) * len(FEATURE_CASES))
        # At least each case's own block (every rank's diagonal step) is an op call; the
        # block paths would make none.
        assert all(n >= len(CASES) for n in result["calls"].values()), result["calls"]


# ---- choosing the kernel -----------------------------------------------------------------


def test_auto_picks_torch_flash_on_cuda_without_flash_attn() -> None:
    gpu, gpu_flash = Platform(cuda=True, ring_flash_attn=False), Platform(True, True)
    pick = choose_kernel("auto", platform=gpu, dtype="bfloat16")
    assert pick.kernel == "torch_flash"
    pick = choose_kernel("auto", platform=gpu_flash, dtype="float16", sharding="zigzag", ring=2)
    assert pick.kernel == "torch_flash" and "zigzag" in pick.reason
    assert choose_kernel("auto", platform=gpu_flash).kernel == "flash"
    fp32 = choose_kernel("auto", platform=gpu_flash, dtype="float32")
    assert fp32.kernel == "torch" and "bf16/fp16" in fp32.reason
    assert choose_kernel("auto", platform=Platform(False, False)).kernel == "torch"
    with pytest.raises(LayoutError, match="zigzag"):
        Layout(sp=2, sharding="zigzag", kernel="flash")

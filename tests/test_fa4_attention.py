"""The ``fa4`` kernel (flash-attn 4's functions behind the flash op's interface) on CPU.

``tests/fa4_standin.py`` stands in for ``flash_attn.cute.interface`` (its argument names,
window conventions and five-value return, read from flash-attn-4 4.0.0b36). Here: the
window translation (aten's ``-1``/causal flags to flash-attn 4's ``None`` windows) gives the
masks dense attention gives, and the kernel equals the float64 reference on the shared cases
in one process (the multi-process strategies are in ``tests/test_cudnn_attention.py``).
Choosing and refusing the kernel is in ``tests/test_kernel_choice.py``.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel.fa4_attention import ops_for, use_fa4_ops
from longctx_cli.parallel.torch_kernel import AttentionFeatures, doc_causal_attention
from tests import fa4_standin
from tests.attention_cases import CASES, TOL, rel_err, run_case
from tests.layouts import rank_state
from tests.test_torch_flash import dense_reference


@pytest.fixture
def fa4_calls():
    previous = use_fa4_ops(ops_for(fa4_standin.MODULE, supports=lambda q: True, name="stand-in"))
    yield fa4_standin.CALLS
    use_fa4_ops(previous)


@pytest.mark.parametrize(("causal", "left", "right", "mask"), [
    (True, -1, 0, (-1, 0)),  # causal: bottom-right, unbounded left
    (False, 3, 0, (3, 0)),  # a sliding window of 4 as the torch_flash kernel passes it
    (False, -1, -1, (-1, -1)),  # no mask
])
def test_window_translation_gives_the_dense_masks(causal, left, right, mask) -> None:
    g = torch.Generator().manual_seed(2)
    seqs = [(4, 9), (6, 6)]
    q = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(15, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32)
    ops = ops_for(fa4_standin.MODULE, supports=lambda q: True)
    out, lse, *_ = ops.forward(q, k, v, cu_q, cu_k, 6, 9, 0.0, causal, False, scale=0.5,
                               window_size_left=left, window_size_right=right)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_reference(*leaves, seqs, 0.5, *mask)
    assert lse.shape == (4, 10) and rel_err(lse, ref_lse.detach()) < 1e-6
    assert rel_err(out, ref.detach()) < 1e-12
    ref.backward(dout)
    grads = ops.backward(dout, q, k, v, out, lse, cu_q, cu_k, 6, 9, 0.0, causal, None, None,
                         scale=0.5, window_size_left=left, window_size_right=right)
    for got, leaf in zip(grads, leaves, strict=True):
        assert rel_err(got, leaf.grad) < 1e-6


def test_single_process_matches_reference(fa4_calls) -> None:
    ctx = rank_state(layout="zigzag", kernel="fa4")
    before = dict(fa4_calls)
    for i, name in enumerate(("packed_inside", "one_token_docs", "gqa_8q_2kv")):
        lengths, hq, hkv = CASES[name]
        errors = run_case(ctx, lengths, hq, hkv, seed=i, window=5 if i == 0 else None)
        assert max(errors.values()) < TOL, (name, errors)
    assert fa4_calls["forward"] > before["forward"]
    assert fa4_calls["backward"] > before["backward"]


def test_softcap_takes_the_fallback(fa4_calls) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 8, generator=g) for _ in range(3))
    feats = AttentionFeatures(0.3, softcap=2.0)
    before = fa4_calls["forward"]
    got = doc_causal_attention(q, k, v, [0, 16], feats, kernel="fa4")
    assert fa4_calls["forward"] == before
    assert rel_err(got, doc_causal_attention(q, k, v, [0, 16], feats)) < TOL

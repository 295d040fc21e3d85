"""Shared pair prompts (`prefix_sharing`) at the kernel, row and config level.

A branch document (positions starting at `s > 0`) sees the first `s` keys of the last
document that started at 0, then itself causally. The kernels must compute exactly that:
checked here against dense attention with that mask written out (float64), forward and
gradients, for the torch kernel, for torch_flash (through the CPU stand-in of PyTorch's flash
op: its varlen calls over the documents, one more unmasked call per branch for the prefix,
merged through the log-sum-exp) and for the flash kernel, whose flash-attn functions cannot
take a second key range and hand such rows to PyTorch's flash op.
Whole-model exactness against TRL's unshared computation, in every strategy, is in
tests/test_preference.py; `longctx train` with it in tests/test_preference_train.py.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel.attention import sp_attention
from longctx_cli.parallel.sharding import document_cu_seqlens, document_prefixes, make_sp_meta
from longctx_cli.parallel.torch_flash import use_flash_ops
from longctx_cli.parallel.torch_kernel import doc_causal_attention
from tests import torch_flash_standin as standin
from tests.layouts import sp_state

# A row: a 12-token document, a branch continuing its first 7 tokens (5 of its own), a plain
# 4-token document, and a branch of that one's first 2 tokens (3 of its own).
POSITIONS = [*range(12), *range(7, 12), *range(4), *range(2, 5)]
# GRPO's rows: a 7-token prompt with a 3-token completion after it, three more completions
# as branches from the prompt's last token (position 6), then a second group of two.
GROUP_POSITIONS = [*range(10), *range(6, 9), *range(6, 10), *range(6, 8),
                   *range(6), *range(5, 9)]


def visible(positions: list[int]) -> torch.Tensor:
    """[T, T] bool: what each query may see, written from the definition."""
    n = len(positions)
    doc_of, root_of, start = [], [], 0
    root = 0
    for t, p in enumerate(positions):
        if t == 0 or p != positions[t - 1] + 1:
            start = t
            if p == 0:
                root = t
        doc_of.append(start)
        root_of.append(root)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, doc_of[i] : i + 1] = True  # its own document, causally
        first = positions[doc_of[i]]
        if doc_of[i] != root_of[i]:  # a branch: the root's first `first` tokens too
            mask[i, root_of[i] : root_of[i] + first] = True
    return mask


def test_row_structure():
    pos = torch.tensor(POSITIONS)
    cu = tuple(document_cu_seqlens(pos).tolist())
    assert cu == (0, 12, 17, 21, 24)
    assert document_prefixes(pos, cu) == ((12, 0, 7), (21, 17, 19))
    with pytest.raises(ValueError, match="fewer"):  # a branch longer than its root's start
        bad = torch.tensor([*range(3), *range(5, 7)])
        document_prefixes(bad, tuple(document_cu_seqlens(bad).tolist()))


@pytest.mark.parametrize("positions", [POSITIONS, GROUP_POSITIONS], ids=["pairs", "groups"])
@pytest.mark.parametrize("kernel", ["torch", "torch_flash", "flash-ring", "flash-ulysses"])
def test_kernel_matches_dense_mask(kernel, positions):
    torch.manual_seed(0)
    n, hq, hk, d = len(positions), 4, 2, 8
    q, k, v = (torch.randn(n, h, d, requires_grad=True) for h in (hq, hk, hk))
    pos = torch.tensor(positions)
    cu = document_cu_seqlens(pos)
    prefixes = document_prefixes(pos, tuple(cu.tolist()))
    scale = d ** -0.5

    previous = use_flash_ops(standin.OPS)
    try:
        if kernel.startswith("flash"):  # the strategies' flash path, one rank
            state = sp_state(kernel="flash", mode=kernel.split("-")[1])
            out = sp_attention(q, k, v, make_sp_meta(pos, state), scale)
        else:
            out = doc_causal_attention(q, k, v, cu, scale, kernel=kernel, prefixes=prefixes)
        grad_out = torch.randn_like(out)
        mine = torch.autograd.grad(out, (q, k, v), grad_out)
    finally:
        use_flash_ops(previous)

    rep = hq // hk
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kr, vr = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q64, kr) * scale
    scores = scores.masked_fill(~visible(positions), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr)
    ref = torch.autograd.grad(dense, (q64, k64, v64), grad_out.double())
    for got, want in zip((out, *mine), (dense, *ref), strict=True):
        err = float((got.double() - want).norm() / want.norm())
        assert err < 1e-5, err  # float32 kernels against float64 (the suite's bar)

"""Image runs whose tokens attend to each other both ways (Gemma 3), in the local kernel.

`doc_causal_attention` with `bidirectional` runs equals dense attention under the mask
transformers' own functions build for Gemma 3 (`masking_utils`, Gemma 3's block ids): causal
OR same image run, AND (sliding layers) the key no older than the window, within each
document. Forward and gradients, every block path (the CPU op, its masked edge, the matmul
path CUDA takes), windows narrower and wider than an image, and a document that is one image.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel import cpu_flash
from longctx_cli.parallel.block_geometry import full_row_segments
from longctx_cli.parallel.features import AttentionFeatures
from longctx_cli.parallel.torch_kernel import doc_causal_attention

# Two documents: the first holds two images (one at its very start), the second one image
# that ends the document.
CU = (0, 40, 64)
RUNS = ((0, 6), (17, 29), (55, 64))


def _dense_mask(cu, runs, window: int | None) -> torch.Tensor:
    """[T, T] bool: what transformers' Gemma 3 mask lets query i see, document by document
    (as each document's own forward builds it)."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    total = cu[-1]
    keep = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        types = torch.zeros(1, b - a, dtype=torch.long)
        for s, e in runs:
            if a <= s < b:
                types[0, s - a:e - a] = 1
        mask = or_masks(causal_mask_function, blockwise_overlay(
            get_block_sequence_ids_for_mask(types)))
        if window is not None:
            mask = and_masks(mask, sliding_window_overlay(window))
        idx = torch.arange(b - a)
        keep[a:b, a:b] = mask(0, 0, idx[:, None], idx[None, :])
    return keep


def _dense(q, k, v, feats: AttentionFeatures, cu=CU, runs=RUNS) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * feats.scale
    if feats.softcap is not None:
        s = feats.softcap * torch.tanh(s / feats.softcap)
    s = s.masked_fill(~_dense_mask(cu, runs, feats.window), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_segments_cut_documents_at_image_runs() -> None:
    segs = full_row_segments(CU, (), RUNS)
    assert [(s.q_start, s.q_end, s.k_start, s.k_end, s.bidirectional) for s in segs] == [
        (0, 6, 0, 6, True), (6, 17, 0, 17, False), (17, 29, 0, 29, True),
        (29, 40, 0, 40, False), (40, 55, 40, 55, False), (55, 64, 40, 64, True)]
    with pytest.raises(ValueError, match="crosses a document"):
        full_row_segments(CU, (), ((35, 45),))


@pytest.mark.parametrize("matmul", [False, True], ids=["cpu-op", "matmul"])
@pytest.mark.parametrize("window, softcap, cu, runs", [
    (None, None, CU, RUNS), (4, None, CU, RUNS), (9, None, CU, RUNS), (30, None, CU, RUNS),
    (5, 3.0, CU, RUNS), (None, 3.0, CU, RUNS),
    (None, None, (0, 8), ((0, 8),)),  # one document, one image: no causal segment at all
])
def test_bidirectional_runs_equal_the_dense_mask(window, softcap, cu, runs, matmul,
                                                 monkeypatch) -> None:
    if matmul:  # the path CUDA takes for every block (the CPU op otherwise)
        monkeypatch.setattr(cpu_flash, "use_tiled_path", lambda q, feats: True)
    gen = torch.Generator().manual_seed(0)
    n = cu[-1]
    q = torch.randn(n, 4, 8, generator=gen, dtype=torch.float32).requires_grad_()
    k = torch.randn(n, 2, 8, generator=gen, dtype=torch.float32).requires_grad_()
    v = torch.randn(n, 2, 8, generator=gen, dtype=torch.float32).requires_grad_()
    feats = AttentionFeatures(scale=0.3, window=window, softcap=softcap)
    dout = torch.randn(n, 4, 8, generator=gen, dtype=torch.float32)
    got = doc_causal_attention(q, k, v, cu, feats, bidirectional=runs)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = _dense(q, k, v, feats, cu, runs)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    # The runs change the result: causal attention alone differs (the test can fail).
    causal = doc_causal_attention(q, k, v, cu, feats)
    assert not torch.allclose(causal, want)


# ---- the fused kernels (CPU stand-ins of the CUDA ops, their signatures and semantics) ----


@pytest.fixture
def fused_ops():
    """Every fused kernel pointed at its stand-in; yields each one's forward-call counter."""
    from longctx_cli.parallel.cudnn_attention import use_cudnn_ops
    from longctx_cli.parallel.fa4_attention import ops_for, use_fa4_ops
    from longctx_cli.parallel.torch_flash import use_flash_ops
    from tests import cudnn_standin, fa4_standin
    from tests import torch_flash_standin as flash_standin

    flash = use_flash_ops(flash_standin.OPS)
    cudnn = use_cudnn_ops(cudnn_standin.OPS)
    fa4 = use_fa4_ops(ops_for(fa4_standin.MODULE, supports=lambda q: True, name="stand-in"))
    yield {"torch_flash": flash_standin.CALLS, "cudnn": cudnn_standin.CALLS,
           "fa4": fa4_standin.CALLS}
    use_flash_ops(flash)
    use_cudnn_ops(cudnn)
    use_fa4_ops(fa4)


@pytest.mark.parametrize("kernel", ["torch_flash", "cudnn", "fa4"])
@pytest.mark.parametrize("window", [None, 4, 30])
def test_fused_kernels_run_the_causal_rows_and_the_images_exactly(fused_ops, kernel,
                                                                  window) -> None:
    """On a GPU the op takes the causal segments in one varlen call and each image in one
    non-causal block (under a window narrower than the image's keys, the block paths take
    its rows): the result is the dense mask's, and the op was called."""
    gen = torch.Generator().manual_seed(2)
    n = CU[-1]
    q = torch.randn(n, 4, 16, generator=gen).requires_grad_()
    k = torch.randn(n, 2, 16, generator=gen).requires_grad_()
    v = torch.randn(n, 2, 16, generator=gen).requires_grad_()
    dout = torch.randn(n, 4, 16, generator=gen)
    feats = AttentionFeatures(scale=0.25, window=window)
    def op_calls() -> int:  # cuDNN hands windowed calls to the flash op
        return sum(sum(c.values()) for c in fused_ops.values())

    before = op_calls()
    got = doc_causal_attention(q, k, v, CU, feats, kernel=kernel, bidirectional=RUNS)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    assert op_calls() > before  # an op ran, not only the block paths
    want = _dense(q, k, v, feats)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)

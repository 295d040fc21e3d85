"""Image runs whose tokens attend to each other both ways (Gemma 3), in the local kernel.

`doc_causal_attention` with `bidirectional` runs equals dense attention under the mask
transformers builds for Gemma 3: within a document, causal OR same image run, AND (sliding
layers) the key no older than the window. Forward and gradients, every block path (the CPU
op, its masked edge, the matmul path under softcapping), windows narrower and wider than
an image.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel.features import AttentionFeatures
from longctx_cli.parallel.torch_kernel import doc_causal_attention, full_row_segments

# Two documents: the first holds two images (one at its very start), the second one image
# that ends the document.
CU = (0, 40, 64)
RUNS = ((0, 6), (17, 29), (55, 64))


def _dense_mask(total: int, window: int | None) -> torch.Tensor:
    """[T, T] bool: what transformers' Gemma 3 mask lets query i see."""
    doc = torch.zeros(total, dtype=torch.long)
    for d, (a, b) in enumerate(zip(CU[:-1], CU[1:], strict=True)):
        doc[a:b] = d
    run = torch.full((total,), -1)
    for r, (a, b) in enumerate(RUNS):
        run[a:b] = r
    q = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    keep = (k <= q) | ((run[:, None] == run[None, :]) & (run[:, None] >= 0))
    if window is not None:
        keep &= k > q - window
    return keep & (doc[:, None] == doc[None, :])


def _dense(q, k, v, feats: AttentionFeatures) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * feats.scale
    if feats.softcap is not None:
        s = feats.softcap * torch.tanh(s / feats.softcap)
    s = s.masked_fill(~_dense_mask(q.shape[0], feats.window), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_segments_cut_documents_at_image_runs() -> None:
    segs = full_row_segments(CU, (), RUNS)
    assert [(s.q_start, s.q_end, s.k_start, s.k_end, s.bidirectional) for s in segs] == [
        (0, 6, 0, 6, True), (6, 17, 0, 17, False), (17, 29, 0, 29, True),
        (29, 40, 0, 40, False), (40, 55, 40, 55, False), (55, 64, 40, 64, True)]
    with pytest.raises(ValueError, match="crosses a document"):
        full_row_segments(CU, (), ((35, 45),))


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (9, None), (30, None),
                                             (5, 3.0), (None, 3.0)])
def test_bidirectional_runs_equal_the_dense_mask(window, softcap) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(64, 4, 8, generator=gen, dtype=torch.float32).requires_grad_()
    k = torch.randn(64, 2, 8, generator=gen, dtype=torch.float32).requires_grad_()
    v = torch.randn(64, 2, 8, generator=gen, dtype=torch.float32).requires_grad_()
    feats = AttentionFeatures(scale=0.3, window=window, softcap=softcap)
    dout = torch.randn(64, 4, 8, generator=gen, dtype=torch.float32)
    got = doc_causal_attention(q, k, v, CU, feats, bidirectional=RUNS)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = _dense(q, k, v, feats)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    # The runs change the result: causal attention alone differs (the test can fail).
    causal = doc_causal_attention(q, k, v, CU, feats)
    assert not torch.allclose(causal, want)

"""Test-only CPU stand-in of flash-attn 4's two functions the ``fa4`` kernel calls.

Written from ``flash_attn/cute/interface.py`` of ``flash-attn-4`` 4.0.0b36 (the functions
PyTorch's own FA4 registration, ``torch/nn/attention/_fa4.py``, calls too):

* ``_flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
  seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, ..., softmax_scale=None,
  causal=False, softcap=None, window_size_left=None, window_size_right=None, ...,
  return_lse=False, ...)`` returns five values, ``(out, lse, p, row_max, o_lo)``; varlen
  ``lse`` is ``[num_head, total_q]`` float32, natural log;
* ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
  window_size_left=None, window_size_right=None, ..., cu_seqlens_q=None, cu_seqlens_k=None,
  seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
  ...)`` returns ``(dq, dk, dv)`` and asserts ``lse.shape == (num_head, total_q)``;
* ``_resolve_causal_local_window``: windows of ``None`` are unbounded, negative pairs mean
  none, ``causal`` forces the right window to 0, ``(None, 0)`` is plain causal; masks align
  to the bottom right of each sequence (``mask.py``), as flash-attn 2's do.

The mask math is shared with ``tests/torch_flash_standin.py`` (the same conventions), which
is itself checked against dense attention; what is specific to flash-attn 4 (argument names
and order, ``None`` windows, the five-value return) lives here.
"""

from __future__ import annotations

import types

import torch

from tests import torch_flash_standin as fa2

CALLS = {"forward": 0, "backward": 0}


def _resolve(causal, left, right):
    """flash-attn 4's ``_resolve_causal_local_window`` (without mask_mod)."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, None, None
        return False, left, right
    return False, None, None


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                    seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                    page_table=None, softmax_scale=None, causal=False, softcap=None,
                    window_size_left=None, window_size_right=None, learnable_sink=None,
                    return_lse=False, out=None, lse=None, **unused):
    assert qv is None and seqused_q is None and seqused_k is None and page_table is None
    assert softcap is None and learnable_sink is None and out is None and lse is None
    assert cu_seqlens_q is not None and cu_seqlens_k is not None, "the kernel calls varlen"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.stride(0) == 1
    assert return_lse
    CALLS["forward"] += 1
    causal, left, right = _resolve(causal, window_size_left, window_size_right)
    o, lse, *_ = fa2.flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=softmax_scale, window_size_left=left, window_size_right=right,
    )
    return o, lse, None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                    window_size_left=None, window_size_right=None, cu_seqlens_q=None,
                    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, deterministic=False, **unused):
    assert softcap == 0.0 and seqused_q is None and seqused_k is None
    assert cu_seqlens_q is not None and cu_seqlens_k is not None
    assert lse.shape == (q.shape[1], q.shape[0]), "lse must have shape (num_head, total_q)"
    assert lse.dtype == torch.float32
    assert out.shape == dout.shape == (*q.shape[:2], v.shape[-1])
    CALLS["backward"] += 1
    causal, left, right = _resolve(causal, window_size_left, window_size_right)
    return fa2.flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, 0.0, causal, torch.zeros(2), torch.empty(0), scale=softmax_scale,
        window_size_left=left, window_size_right=right,
    )


MODULE = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)

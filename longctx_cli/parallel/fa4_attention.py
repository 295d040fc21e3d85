"""The ``fa4`` kernel: flash-attn 4 (package ``flash-attn-4``, CuTe DSL, module
``flash_attn.cute``) for the segment blocks, behind the ``torch_flash`` kernel's interface.

Two routes exist; this one calls flash-attn 4's own functions:

* ``torch.nn.attention.activate_flash_attention_impl("FA4")`` (torch >= 2.10) swaps the CUDA
  kernels behind ``aten._flash_attention_forward/backward`` for the whole process (every SDPA
  call too). In torch 2.13's ``torch/nn/attention/_fa4.py`` that swap unpacks
  ``out, lse = _flash_attn_fwd(...)``, while flash-attn-4 4.0.0b36's ``_flash_attn_fwd``
  returns five values (``out, lse, p, row_max, o_lo``), so the swap fails with the current
  pre-release; it also cannot be exercised off a GPU (its ops check ``is_cuda`` first).
* This module adapts the same two functions PyTorch's registration calls,
  ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, to the signatures of
  ``aten._flash_attention_forward/backward`` (:class:`~.torch_flash.FlashOps`), so every
  piece of the ``torch_flash`` kernel (runs of segments, P2P pieces, GQA, windows, padded MLA
  head dims) runs on flash-attn 4 unchanged, and a CPU stand-in of the two functions tests it.

What was read in ``flash_attn/cute/interface.py`` (4.0.0b36) and relied on here: varlen
tensors ``[total, heads, dim]`` with int32 ``cu_seqlens_q/k``; ``window_size_left/right`` of
``None`` mean unbounded (PyTorch's wrapper maps aten's ``-1`` to ``None`` the same way), and
``causal=True`` means a right window of 0 aligned to the bottom right of each sequence
(``mask.py``: ``causal_row_offset = 1 + seqlen_k - ... - seqlen_q``), so a sliding window ``W``
is ``(W - 1, 0)`` as for flash-attn 2; ``return_lse=True`` gives the log-sum-exp
``[heads, total_q]`` float32 in natural-log units (``softmax.py`` multiplies the base-2
statistics by ``ln 2``); ``_flash_attn_bwd(q, k, v, out, dout, lse, ...)`` takes any
``lse`` of that shape (the merged one, in our use) and returns ``dq, dk, dv``; GQA when the
query heads are a multiple of the KV heads; fp16/bf16 only; head dims on sm90 from 8 to 256
in steps of 8, on sm100/sm110 up to 128 or exactly 256 (``_validate_head_dims``). No softcap
argument reaches it through this interface (softcapped layers take the tiled matmul path, and
``kernel_choice`` refuses ``fa4`` for such models).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from longctx_cli.kernel_choice import FA4_MAJORS, FA4_MODULE, fa4_head_dim_fits

from .features import AttentionFeatures, Segment
from .torch_flash import HALF_DTYPES, FlashOps, flash_applies
from .torch_flash import block_backward as flash_block_backward
from .torch_flash import block_forward as flash_block_forward
from .torch_flash import varlen_backward as flash_varlen_backward
from .torch_flash import varlen_forward as flash_varlen_forward

FA4_FUNCTIONS = ("_flash_attn_fwd", "_flash_attn_bwd")


def _window(size: int | None) -> int | None:
    """aten's ``-1`` (unbounded) is flash-attn 4's ``None``."""
    return None if size is None or size < 0 else size


@lru_cache(maxsize=8)
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _supports(q: torch.Tensor) -> bool:
    if not q.is_cuda or q.dtype not in HALF_DTYPES:
        return False
    major = _capability_major(q.device)
    return major in FA4_MAJORS and fa4_head_dim_fits(major, q.shape[-1])


def ops_for(module: Any, supports: Any = _supports, name: str = FA4_MODULE) -> FlashOps:
    """:class:`FlashOps` that run flash-attn 4's two functions found on ``module``."""

    def forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None, max_q: int, max_k: int,
        dropout_p: float, is_causal: bool, return_debug_mask: bool, *,
        scale: float | None = None, window_size_left: int | None = None,
        window_size_right: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        if dropout_p or return_debug_mask:
            raise ValueError("flash-attn 4 runs without dropout and debug masks")
        out, lse, *_ = module._flash_attn_fwd(
            query, key, value, cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=is_causal,
            window_size_left=_window(window_size_left),
            window_size_right=_window(window_size_right), return_lse=True,
        )
        return out, lse, None, None, None

    def backward(
        grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: torch.Tensor | None,
        cum_seq_k: torch.Tensor | None, max_q: int, max_k: int, dropout_p: float,
        is_causal: bool, rng_state: Any, unused: Any, *, scale: float | None = None,
        window_size_left: int | None = None, window_size_right: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if dropout_p:
            raise ValueError("flash-attn 4 runs without dropout")
        dq, dk, dv, *_ = module._flash_attn_bwd(
            query, key, value, out, grad_out, logsumexp, softmax_scale=scale,
            causal=is_causal, window_size_left=_window(window_size_left),
            window_size_right=_window(window_size_right), cu_seqlens_q=cum_seq_q,
            cu_seqlens_k=cum_seq_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return dq, dk, dv

    return FlashOps(forward=forward, backward=backward, supports=supports, name=name)


def import_fa4() -> ModuleType:
    """flash-attn 4's interface module; ImportError (or what its CUDA setup raises) if absent,
    and ImportError when it lacks the two functions this kernel calls."""
    module = importlib.import_module(FA4_MODULE)
    missing = [f for f in FA4_FUNCTIONS if not hasattr(module, f)]
    if missing:
        raise ImportError(f"{FA4_MODULE} has no {', '.join(missing)}", name=FA4_MODULE)
    return module


_ops: FlashOps | None = None


def fa4_ops() -> FlashOps:
    """The ops the ``fa4`` kernel calls (imported on first use: a GPU-only optional package)."""
    global _ops
    if _ops is None:
        _ops = ops_for(import_fa4())
    return _ops


def use_fa4_ops(ops: FlashOps | None) -> FlashOps | None:
    """Point the kernel at other ops (a test stand-in); returns the previous ones."""
    global _ops
    previous, _ops = _ops, ops
    return previous


# The ``torch_flash`` kernel's entry points on the ops above, read at each call (a test's
# stand-in installed with `use_fa4_ops` is what runs; `fa4_ops` imports on first use).


def applies(q: torch.Tensor, feats: AttentionFeatures, v: torch.Tensor | None = None) -> bool:
    """True when flash-attn 4 computes this call exactly (:func:`.torch_flash.flash_applies`)."""
    return flash_applies(q, feats, v, _ops or fa4_ops())


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segments: Sequence[Segment], feats: AttentionFeatures
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.torch_flash.varlen_forward` on flash-attn 4."""
    return flash_varlen_forward(q, k, v, segments, feats, _ops or fa4_ops())


def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, segments: Sequence[Segment],
                    feats: AttentionFeatures) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.torch_flash.varlen_backward` on flash-attn 4."""
    return flash_varlen_backward(dout, q, k, v, out, lse, segments, feats, _ops or fa4_ops())


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  feats: AttentionFeatures) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.torch_flash.block_forward` on flash-attn 4."""
    return flash_block_forward(q, k, v, causal, feats, _ops or fa4_ops())


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, feats: AttentionFeatures
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.torch_flash.block_backward` on flash-attn 4."""
    return flash_block_backward(dout, q, k, v, out, lse, causal, feats, _ops or fa4_ops())

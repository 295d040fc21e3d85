"""The attention kernel of a layout, resolved once into what the strategies call.

``kernel_choice.choose_kernel`` names the kernel in the plan's :class:`~longctx_cli.layout.Layout`;
:func:`resolve_kernel` is the one place that reads that name: every
:class:`~.mesh.ParallelState` resolves its layout's kernel when it is made, and strategies and
block functions call what it holds (``ctx.kernel``), never the name.

* ``torch``: no fused ops; every block runs on the block paths (PyTorch's CPU flash op, or
  the tiled matmul path on CUDA and for softcapped layers, :mod:`.cpu_flash`).
* ``torch_flash``: PyTorch's flash op (:mod:`.torch_flash`) wherever it computes a call
  exactly, the block paths otherwise.
* ``cudnn``: PyTorch's cuDNN attention ops (:mod:`.cudnn_attention`); a call they cannot take
  exactly (a window, a softcap) goes to PyTorch's flash op where that applies
  (``kernel_choice`` refuses such models for ``cudnn``, so this is a guard, not a route).
* ``fa4``: flash-attn 4's functions behind the flash op's interface (:mod:`.fa4_attention`).
* ``flash``: flash-attn 2 and ring-flash-attn's own functions for the rows they take
  (``attention.strategy_for`` picks those strategies); every other row, and every block,
  on PyTorch's flash op, present wherever flash-attn runs.

The fused ops are looked up at call time through each module's ``use_*_ops`` (a test's CPU
stand-in included), so a kernel resolved before a stand-in is installed still reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from longctx_cli.layout import Kernel

from .cudnn_attention import applies as cudnn_applies
from .cudnn_attention import block_backward as cudnn_block_backward
from .cudnn_attention import block_forward as cudnn_block_forward
from .cudnn_attention import varlen_backward as cudnn_varlen_backward
from .cudnn_attention import varlen_forward as cudnn_varlen_forward
from .fa4_attention import applies as fa4_applies
from .fa4_attention import block_backward as fa4_block_backward
from .fa4_attention import block_forward as fa4_block_forward
from .fa4_attention import varlen_backward as fa4_varlen_backward
from .fa4_attention import varlen_forward as fa4_varlen_forward
from .features import AttentionFeatures
from .torch_flash import (
    block_backward,
    block_forward,
    flash_applies,
    varlen_backward,
    varlen_forward,
)


@dataclass(frozen=True)
class FusedOps:
    """A fused kernel's entry points (the signatures of :mod:`.torch_flash`'s) and the test
    of whether it computes a call exactly.

    ``applies(q, feats, v)``: True when these ops take the call; ``fallback``: the ops asked
    next when they do not (None: the block paths).
    """

    applies: Callable[[torch.Tensor, AttentionFeatures, torch.Tensor | None], bool]
    varlen_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    block_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    block_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    fallback: FusedOps | None = None


TORCH_FLASH_OPS = FusedOps(flash_applies, varlen_forward, varlen_backward, block_forward,
                           block_backward)
CUDNN_OPS = FusedOps(cudnn_applies, cudnn_varlen_forward, cudnn_varlen_backward,
                     cudnn_block_forward, cudnn_block_backward, fallback=TORCH_FLASH_OPS)
FA4_OPS = FusedOps(fa4_applies, fa4_varlen_forward, fa4_varlen_backward, fa4_block_forward,
                   fa4_block_backward)


@dataclass(frozen=True)
class AttentionKernel:
    """What a layout's kernel computes with, resolved once by :func:`resolve_kernel`.

    ``fused``: the ops the block functions (:mod:`.torch_kernel`) run on wherever they
    apply; None runs every block on the block paths. ``flash_attn``: flash-attn 2 and
    ring-flash-attn's own functions compute the rows they take (the ``flash`` kernel).
    """

    name: Kernel
    fused: FusedOps | None = None
    flash_attn: bool = False


_KERNELS: dict[str, AttentionKernel] = {
    "torch": AttentionKernel("torch"),
    "torch_flash": AttentionKernel("torch_flash", TORCH_FLASH_OPS),
    "cudnn": AttentionKernel("cudnn", CUDNN_OPS),
    "fa4": AttentionKernel("fa4", FA4_OPS),
    "flash": AttentionKernel("flash", TORCH_FLASH_OPS, flash_attn=True),
}
TORCH = _KERNELS["torch"]


def resolve_kernel(name: Kernel) -> AttentionKernel:
    """The :class:`AttentionKernel` of a layout's ``kernel`` (one of ``CONCRETE_KERNELS``)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown attention kernel {name!r}; expected one of "
                         f"{', '.join(_KERNELS)}") from None


def as_kernel(kernel: AttentionKernel | Kernel) -> AttentionKernel:
    """``kernel`` resolved: strategies pass their state's ``ctx.kernel``; a name (a test's or
    a benchmark's direct call) is resolved here."""
    return kernel if isinstance(kernel, AttentionKernel) else resolve_kernel(kernel)


def fused_for(kernel: AttentionKernel | Kernel, q: torch.Tensor, feats: AttentionFeatures,
              v: torch.Tensor | None = None) -> FusedOps | None:
    """The fused ops of ``kernel`` that compute this call exactly (the first that applies:
    the kernel's own, then its fallbacks), or None for the block paths."""
    if not isinstance(kernel, AttentionKernel):
        kernel = resolve_kernel(kernel)  # a name, from a direct call (tests, benchmarks)
    ops = kernel.fused
    while ops is not None and not ops.applies(q, feats, v):
        ops = ops.fallback
    return ops

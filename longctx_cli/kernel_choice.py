"""Which attention kernel runs: the one place that decides (no torch import).

``validate`` (config/rules.py) and every rank (parallel/mesh.py) call :func:`choose_kernel`
with what they know about the machine, so the plan prints the kernel the ranks really run.

Kernels:

* ``flash``: ring-flash-attn + flash-attn (CUDA, optional packages; contiguous sharding for
  the llama3 ring, every layout for the P2P rings);
* ``torch_flash``: our ring/Ulysses/hybrid with PyTorch's own flash-attention op for the
  blocks (CUDA, bf16/fp16, no extra package, every sharding);
* ``torch``: our ring/Ulysses/hybrid with pure-PyTorch blocks: the CPU flash op on CPU, the
  tiled matmul path (score tiles of ``TILE x TILE``) on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "torch", "flash", "torch_flash")
HALF_DTYPES = ("bfloat16", "float16")
# Query rows and keys per score tile of the tiled matmul path (parallel/kernels.py _TILE).
TILE = 1024


class KernelError(ValueError):
    """An explicit kernel request this layout cannot run; ``fix`` says what to change."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message} {fix}")
        self.message, self.fix = message, fix


@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # torch | flash | torch_flash, never auto
    reason: str


def choose_kernel(
    requested: str,
    layout: str = "contiguous",
    *,
    cuda: bool,
    flash_attn: bool,
    dtype: str | None = None,
    ring_attn_func: str = "varlen_llama3",
) -> KernelChoice:
    """Resolve ``attention_kernel`` for a layout and a machine.

    ``flash_attn``: flash-attn and ring-flash-attn are importable; ``dtype``: the compute
    dtype (None: unknown, taken as half precision). Explicit requests are kept as asked
    (whether the machine can run them is for ``validate`` to say); only a layout a kernel
    cannot compute is refused here.
    """
    if requested not in KERNELS:
        raise KernelError(
            f"unknown attention kernel {requested!r}.", f"use one of {', '.join(KERNELS)}."
        )
    # ring-flash-attn's llama3 varlen function expects contiguous slices; its P2P ring
    # functions exist for each P2P layout (batch_ring / batch_zigzag / batch_stripe).
    flash_fits = layout == "contiguous" or ring_attn_func != "varlen_llama3"
    if requested == "flash" and not flash_fits:
        raise KernelError(
            f"`sp_sharding` = {layout!r} is not supported by `attention_kernel: flash` "
            "(ring-flash-attn's llama3 varlen kernel expects contiguous slices).",
            "set `sp_sharding: contiguous`, or `attention_kernel: torch_flash` (CUDA) or "
            "`torch` to keep zigzag.",
        )
    if requested != "auto":
        return KernelChoice(requested, "requested")
    half = dtype is None or dtype in HALF_DTYPES
    if cuda and flash_attn and flash_fits and half:
        return KernelChoice("flash", "auto: CUDA, flash-attn and ring-flash-attn installed")
    if cuda and half:
        why = "zigzag sharding" if flash_attn else "flash-attn not installed"
        return KernelChoice("torch_flash", f"auto: CUDA, {why}: PyTorch's flash-attention op")
    if cuda:
        return KernelChoice(
            "torch", f"auto: {dtype} on CUDA: PyTorch's flash op needs bf16/fp16, so the "
            f"tiled matmul path runs ({TILE} x {TILE} score tiles)"
        )
    return KernelChoice("torch", "auto: no CUDA")

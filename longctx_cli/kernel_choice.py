"""Which attention kernel runs: the one place that decides, from facts (no torch import at
module load).

``config.plan.layout_for`` calls :func:`choose_kernel` for ``validate`` and for every rank,
so the plan prints the kernel the ranks run. The facts: what really imports on this
machine (:class:`Platform`), the GPU's compute capability, the compute dtype, the model's
attention (head dim, softcap, sinks, window) and the layout (sharding, ring algorithm).

Kernels:

* ``flash``: ring-flash-attn + flash-attn 2 (CUDA, optional packages; contiguous sharding
  for the llama3 ring, every sharding for the P2P rings);
* ``torch_flash``: our ring/Ulysses/hybrid with PyTorch's own flash-attention op for the
  blocks (CUDA, sm80+, bf16/fp16, head dim a multiple of 8 up to 256; no extra package,
  every sharding);
* ``cudnn``: our ring/Ulysses/hybrid with PyTorch's own cuDNN attention ops for the blocks
  (dense op per one-document block, ragged forward over packed rows; CUDA sm90/sm100, cuDNN 9+,
  bf16/fp16, no window or softcap; no extra package). Contract-tested on CPU, not measured on
  a GPU yet, so ``auto`` does not pick it;
* ``fa4``: the same with flash-attn 4's functions (optional pre-release package
  ``flash-attn-4``, module ``flash_attn.cute``; sm90/sm100, bf16/fp16; no softcap). Never
  picked by ``auto``;
* ``torch``: our ring/Ulysses/hybrid with pure-PyTorch blocks: the CPU flash op on CPU, the
  tiled matmul path (score tiles of ``TILE x TILE``) on CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from longctx_cli.layout import CONCRETE_KERNELS, P2P_SHARDING, flash_fits

# `attention_kernel`: a concrete kernel, or `auto` (chosen from the machine and the model).
KERNELS: tuple[str, ...] = ("auto", *CONCRETE_KERNELS)
KernelRequest = Literal[KERNELS]  # type: ignore[valid-type]
HALF_DTYPES = ("bfloat16", "float16")
# Query rows and keys per score tile of the tiled matmul path (parallel/tiled.py TILE).
TILE = 1024
# What PyTorch's flash op and flash-attn 2 both need (their kernels check the same).
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256
# The modules of ring-flash-attn 0.1.8 longctx calls, and flash-attn 2's CUDA interface.
RING_FLASH_MODULES = (
    "ring_flash_attn.llama3_flash_attn_varlen",
    "ring_flash_attn.ring_flash_attn",
    "ring_flash_attn.zigzag_ring_flash_attn",
    "ring_flash_attn.stripe_flash_attn",
)
FLASH_ATTN_MODULE = "flash_attn.flash_attn_interface"
# PyTorch's cuDNN attention ops (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# MHA.cpp): cuDNN 9.0+; head dim a multiple of 8 up to 128, up to 256 on sm90 (9.0 exactly)
# from cuDNN 9.10.0; the ragged (packed) form runs on sm90 and sm100 only (its nested-tensor
# gate), which is where longctx offers the kernel. torch.backends.cudnn.version() numbers
# cuDNN 9.x.y as 9*10000 + x*100 + y.
CUDNN_MIN_VERSION = 90000
CUDNN_HEAD_DIM_256_VERSION = 91000
CUDNN_MAJORS = (9, 10)
# flash-attn 4 (package flash-attn-4, CuTe DSL): the module longctx calls, and the compute
# capability majors PyTorch's own FA4 registration (torch/nn/attention/_fa4.py) accepts.
FA4_MODULE = "flash_attn.cute.interface"
FA4_MAJORS = (9, 10)


class KernelError(ValueError):
    """An explicit kernel request this run cannot honour; ``fix`` says what to change."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message} {fix}")
        self.message, self.fix = message, fix


@dataclass(frozen=True)
class Platform:
    """What the machine offers (tests and `validate` for a GPU job pass their own).

    ``ring_flash_attn``: flash-attn 2 and the ring-flash-attn modules longctx uses import for
    real. ``capability``: the GPU's compute capability, ``None`` when unknown (a plan made
    for GPU machines elsewhere: assumed Ampere or newer, and the plan says so).
    """

    cuda: bool
    ring_flash_attn: bool
    capability: tuple[int, int] | None = None
    cudnn_version: int | None = None  # torch.backends.cudnn.version(); None: unknown
    fa4: bool | None = None  # flash-attn 4 imports; None: not asked yet (asked for `fa4`)

    @classmethod
    def detect(cls) -> Platform:
        if not _torch_may_have_gpu():
            return cls(cuda=False, ring_flash_attn=False)
        import torch

        if not torch.cuda.is_available():
            return cls(cuda=False, ring_flash_attn=False)
        # flash_attn imports its CUDA extension at import time: try it only on CUDA.
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return cls(cuda=True, ring_flash_attn=flash_kernels_import() is None,
                   capability=tuple(torch.cuda.get_device_capability()),
                   cudnn_version=cudnn)


@dataclass(frozen=True)
class ModelAttention:
    """What the model's attention layers compute, as far as the kernel choice cares."""

    head_dim: int | None = None  # the one head dim a flash kernel computes on
    softcap: bool = False
    sinks: bool = False
    window: bool = False
    chunked: bool = False  # chunked local attention (Llama 4): chunk starts cut the row


@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # one of CONCRETE_KERNELS, never auto
    reason: str


def import_ring_flash_module(name: str) -> types.ModuleType:
    """Import one ring-flash-attn module without running the package's ``__init__`` (which
    imports a transformers adapter that transformers 5 no longer supports)."""
    if name in sys.modules:
        return sys.modules[name]
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("ring-flash-attn is not installed", name="ring_flash_attn")
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
    return importlib.import_module(name)


def flash_kernels_import() -> str | None:
    """None when flash-attn 2's CUDA interface and ring-flash-attn's modules import; else why
    not. A real import, not ``find_spec``: flash-attn 4 installs only ``flash_attn.cute``
    under the same name, and a flash-attn built for another torch fails at import."""
    for name in (FLASH_ATTN_MODULE, *RING_FLASH_MODULES):
        try:
            if name.startswith("ring_flash_attn"):
                import_ring_flash_module(name)
            else:
                importlib.import_module(name)
        except Exception as err:  # ImportError, OSError (ABI), RuntimeError (CUDA setup)
            return f"`{name}` does not import ({type(err).__name__}: {_first_line(err)})"
    return None


def fa4_import() -> str | None:
    """None when flash-attn 4's interface imports with the two functions the ``fa4`` kernel
    calls; else why not (only worth asking on CUDA: CuTe DSL sets up CUDA at import)."""
    try:
        module = importlib.import_module(FA4_MODULE)
    except Exception as err:  # ImportError, or what its CUDA setup raises
        return f"`{FA4_MODULE}` does not import ({type(err).__name__}: {_first_line(err)})"
    missing = [f for f in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(module, f)]
    return f"`{FA4_MODULE}` has no {', '.join(missing)}" if missing else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _torch_may_have_gpu() -> bool:
    """False for a CPU-only torch build, read from its version.py without importing torch
    (~1-2 s), so `validate` answers at once on a laptop; True (ask torch) otherwise."""
    if "torch" in sys.modules:
        return True  # already paid for: let torch answer
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True  # let the import fail the usual way
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return True
    lines = [line.replace(" ", "") for line in text.splitlines()]
    cpu_only = "cuda:Optional[str]=None" in lines or "cuda=None" in lines
    has_rocm_or_xpu = any(
        line.startswith(("hip:", "hip=", "xpu:", "xpu=")) and not line.endswith("=None")
        for line in lines
    )
    return not cpu_only or has_rocm_or_xpu


def flash_op_blockers(platform: Platform, dtype: str | None, head_dim: int | None) -> list[str]:
    """Why flash attention (PyTorch's op or flash-attn 2) cannot run here; empty if it can."""
    why = []
    if not platform.cuda:
        why.append("no CUDA GPU")
    elif platform.capability is not None and platform.capability < FLASH_MIN_CAPABILITY:
        major, minor = platform.capability
        why.append(f"the GPU's compute capability is {major}.{minor} (flash attention needs "
                   "Ampere, 8.0, or newer)")
    if dtype is not None and dtype not in HALF_DTYPES:
        why.append(f"dtype {dtype} (flash attention computes in bf16/fp16)")
    if head_dim is not None and (head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM):
        why.append(f"head_dim {head_dim} (flash attention needs a multiple of 8, at most "
                   f"{FLASH_MAX_HEAD_DIM})")
    return why


def flash_attn_blockers(
    platform: Platform, dtype: str | None, model: ModelAttention, sharding: str,
    ring_attn_func: str, ring: int, packed: bool = False,
) -> list[str]:
    """Why the `flash` kernel (flash-attn 2 + ring-flash-attn) cannot run this exactly."""
    why = flash_op_blockers(platform, dtype, model.head_dim)
    if platform.cuda and not platform.ring_flash_attn:
        why.append("flash-attn 2 / ring-flash-attn do not import here")
    if model.sinks:
        why.append("the model has attention sinks (flash-attn has no sink argument)")
    if ring > 1:
        p2p = ring_attn_func in P2P_SHARDING
        if model.softcap:
            why.append("the model softcaps attention logits (ring-flash-attn's rings do not)")
        if p2p and packed:
            why.append(f"packed rows (`sample_packing`): ring-flash-attn's {ring_attn_func} "
                       "takes one sequence and would attend across documents")
        if p2p and model.chunked:
            why.append(f"the model has chunked attention (ring-flash-attn's {ring_attn_func} "
                       "takes one sequence and would attend across chunks)")
        if p2p and model.window:
            why.append(f"the model has a sliding window (ring-flash-attn's {ring_attn_func} "
                       "has none)")
        if not flash_fits(sharding, ring_attn_func):
            why.append(f"`sp_sharding: {sharding}` (ring-flash-attn's llama3 function "
                       "expects contiguous slices)")
        if ring_attn_func == "batch_ring" and dtype == "float16":
            why.append("ring-flash-attn's batch_ring returns dq in bf16 whatever the input "
                       "dtype, which would round fp16 gradients")
    return why


def cudnn_version_text(version: int) -> str:
    """cuDNN's version number as ``M.m.p``: 9.x.y is 9*10000 + x*100 + y, 8.x.y was
    8*1000 + x*100 + y."""
    major = version // 10000 if version >= 10000 else version // 1000
    return f"{major}.{version // 100 % 100 if version >= 10000 else version // 100 % 10}." \
           f"{version % 100}"


def cudnn_head_dim_limit(platform: Platform) -> int:
    """256 on sm90 with cuDNN 9.10.0 or newer (unknown values assumed so), else 128."""
    cap_ok = platform.capability is None or platform.capability == (9, 0)
    version_ok = (platform.cudnn_version is None
                  or platform.cudnn_version >= CUDNN_HEAD_DIM_256_VERSION)
    return 256 if cap_ok and version_ok else 128


def _half(dtype: str | None, kernel: str) -> list[str]:
    return [] if dtype is None or dtype in HALF_DTYPES else [
        f"dtype {dtype} ({kernel} computes in bf16/fp16)"]


def cudnn_blockers(platform: Platform, dtype: str | None, model: ModelAttention) -> list[str]:
    """Why the ``cudnn`` kernel (PyTorch's cuDNN attention ops) cannot run this exactly."""
    why = []
    if not platform.cuda:
        why.append("no CUDA GPU")
    elif platform.capability is not None and platform.capability[0] not in CUDNN_MAJORS:
        major, minor = platform.capability
        why.append(f"the GPU's compute capability is {major}.{minor} (longctx runs cuDNN "
                   "attention on Hopper 9.0 and Blackwell 10.x, where PyTorch's ragged cuDNN "
                   "op for packed rows runs)")
    if platform.cudnn_version is not None and platform.cudnn_version < CUDNN_MIN_VERSION:
        why.append(f"cuDNN {cudnn_version_text(platform.cudnn_version)} (PyTorch's cuDNN "
                   "attention needs 9.0 or newer)")
    why += _half(dtype, "cuDNN attention")
    limit = cudnn_head_dim_limit(platform)
    if model.head_dim is not None and (model.head_dim % 8 or model.head_dim > limit):
        why.append(f"head_dim {model.head_dim} (cuDNN attention takes a multiple of 8 up to "
                   f"{limit} here{'' if limit == 256 else '; 256 on sm90 with cuDNN 9.10+'})")
    if model.window:
        why.append("the model has a sliding window (PyTorch's cuDNN attention ops take none)")
    if model.softcap:
        why.append("the model softcaps attention logits (PyTorch's cuDNN attention ops have "
                   "no softcap)")
    return why


def fa4_head_dim_fits(major: int | None, head_dim: int) -> bool:
    """flash-attn 4's head dims (its ``_validate_head_dims``, one dim for q, k and v): sm90
    8..256, sm100/sm110 8..128 or 256; a multiple of 8 (bf16/fp16). Unknown GPU: sm90's."""
    if head_dim % 8 or head_dim < 8:
        return False
    if major is None or major == 9:
        return head_dim <= 256
    return head_dim <= 128 or head_dim == 256


def fa4_blockers(platform: Platform, dtype: str | None, model: ModelAttention, ring: int = 1,
                 ring_attn_func: str = "varlen_llama3") -> list[str]:
    """Why the ``fa4`` kernel (flash-attn 4's functions) cannot run this exactly."""
    why = []
    major = None if platform.capability is None else platform.capability[0]
    if not platform.cuda:
        why.append("no CUDA GPU")
    else:
        missing = None if platform.fa4 else fa4_import() if platform.fa4 is None else (
            f"`{FA4_MODULE}` does not import")
        if missing:
            why.append(f"flash-attn 4 is not usable here: {missing}")
        if major is not None and major not in FA4_MAJORS:
            why.append(f"the GPU's compute capability is {major}.{platform.capability[1]} "
                       "(flash-attn 4 runs on Hopper 9.x and Blackwell 10.x, as PyTorch's own "
                       "FA4 registration requires)")
    why += _half(dtype, "flash-attn 4")
    if model.head_dim is not None and not fa4_head_dim_fits(major, model.head_dim):
        why.append(f"head_dim {model.head_dim} (flash-attn 4 takes multiples of 8 up to 256 on "
                   "sm90, up to 128 or exactly 256 on sm100)")
    if model.softcap:
        why.append("the model softcaps attention logits (the fa4 kernel passes no softcap)")
    if ring > 1 and ring_attn_func in P2P_SHARDING and model.window:
        why.append(f"a sliding window under the P2P ring `{ring_attn_func}` (the rows past a "
                   "block's keys would take the tiled matmul path)")
    return why


def cudnn_facts(platform: Platform, dtype: str | None, model: ModelAttention) -> str:
    """What ``validate`` prints about the cuDNN kernel's eligibility on this machine."""
    facts = []
    if platform.capability is not None:
        facts.append(f"sm{platform.capability[0]}{platform.capability[1]}")
    if platform.cudnn_version is not None:
        facts.append(f"cuDNN {cudnn_version_text(platform.cudnn_version)}")
    if dtype is not None:
        facts.append(dtype)
    facts.append(f"head dim {model.head_dim or '?'} <= {cudnn_head_dim_limit(platform)}")
    return ("PyTorch's cuDNN attention ops (" + ", ".join(facts) + "): the dense op per "
            "one-document block, the ragged forward over packed rows; contract-tested on CPU, not "
            "yet measured on a GPU")


def choose_kernel(
    requested: str,
    *,
    platform: Platform,
    dtype: str | None = None,
    model: ModelAttention | None = None,
    sharding: str = "contiguous",
    ring_attn_func: str = "varlen_llama3",
    ring: int = 1,
    packed: bool = False,
) -> KernelChoice:
    """Resolve ``attention_kernel`` for a run; an explicit request that cannot run raises
    :class:`KernelError` with the reason and the fix.

    ``dtype``: the compute dtype (None: unknown, taken as half precision). ``ring``: ranks
    per ring (1 when there is no ring across ranks). ``packed``: rows hold several
    documents (`sample_packing`).
    """
    model = model or ModelAttention()
    if requested not in KERNELS:
        raise KernelError(
            f"unknown attention kernel {requested!r}.", f"use one of {', '.join(KERNELS)}."
        )
    op_blockers = flash_op_blockers(platform, dtype, model.head_dim)
    flash_blockers = flash_attn_blockers(platform, dtype, model, sharding, ring_attn_func,
                                         ring, packed)
    if requested == "torch":
        return KernelChoice("torch", "requested" + _tiled_note(platform, "torch", model, ring,
                                                               ring_attn_func))
    if requested == "torch_flash":
        if op_blockers:
            raise KernelError(
                f"`attention_kernel: torch_flash` cannot run: {'; '.join(op_blockers)}.",
                "use `attention_kernel: auto` (it picks what runs here) or `torch`.",
            )
        return KernelChoice("torch_flash", "requested" + _tiled_note(
            platform, "torch_flash", model, ring, ring_attn_func))
    if requested == "cudnn":
        blockers = cudnn_blockers(platform, dtype, model)
        if blockers:
            raise KernelError(
                f"`attention_kernel: cudnn` cannot run this exactly: {'; '.join(blockers)}.",
                "use `attention_kernel: auto` or `torch_flash` (PyTorch's flash op: Ampere or "
                "newer, windows and softcaps included).",
            )
        return KernelChoice("cudnn", "requested: " + cudnn_facts(platform, dtype, model))
    if requested == "fa4":
        blockers = fa4_blockers(platform, dtype, model, ring, ring_attn_func)
        if blockers:
            raise KernelError(
                f"`attention_kernel: fa4` cannot run this exactly: {'; '.join(blockers)}.",
                "use `attention_kernel: auto` or `torch_flash` (PyTorch's flash op, no extra "
                "package)" + (", or install the pre-release `flash-attn-4` on a Hopper or "
                              "Blackwell GPU (docs/gpu.md)" if platform.cuda else "") + ".",
            )
        return KernelChoice("fa4", "requested: flash-attn 4 (flash_attn.cute) behind the "
                            "flash op's interface; contract-tested on CPU, not yet measured "
                            "on a GPU" + _tiled_note(platform, "fa4", model, ring,
                                                     ring_attn_func))
    if requested == "flash":
        if flash_blockers:
            raise KernelError(
                f"`attention_kernel: flash` cannot run this exactly: "
                f"{'; '.join(flash_blockers)}.",
                "use `attention_kernel: auto` or `torch_flash` (PyTorch's own flash op, no "
                "extra package, every sharding, sinks and softcaps included)"
                + ("" if platform.ring_flash_attn or not platform.cuda else
                   ", or install the flash extra as docs/gpu.md says") + ".",
            )
        return KernelChoice("flash", "requested")
    if not flash_blockers:
        return KernelChoice("flash", "auto: CUDA, flash-attn and ring-flash-attn installed")
    if not op_blockers:
        eligible = platform.capability is not None and not cudnn_blockers(platform, dtype,
                                                                          model)
        unmeasured = "" if not eligible else (
            "; cuDNN attention is eligible here but not measured faster on a GPU yet, so auto "
            "keeps torch_flash (`attention_kernel: cudnn` opts in)")
        return KernelChoice("torch_flash", "auto: PyTorch's flash-attention op, not flash-attn: "
                            + "; ".join(flash_blockers)
                            + _tiled_note(platform, "torch_flash", model, ring,
                                          ring_attn_func) + unmeasured)
    return KernelChoice("torch", "auto: " + "; ".join(op_blockers) + (
        f": the tiled matmul path runs ({TILE} x {TILE} score tiles)" if platform.cuda else ""))


def _tiled_note(platform: Platform, kernel: str, model: ModelAttention, ring: int,
                ring_attn_func: str) -> str:
    """What of the model takes the tiled matmul path under this kernel, if anything."""
    if kernel == "torch" and platform.cuda:
        return f": the tiled matmul path runs ({TILE} x {TILE} score tiles)"
    if kernel == "torch_flash" and model.softcap:
        return "; softcapped attention takes the tiled matmul path (PyTorch's flash op has no " \
               "softcap)"
    if kernel == "torch_flash" and ring > 1 and ring_attn_func in P2P_SHARDING and model.window:
        return (f"; under the sliding window the P2P ring `{ring_attn_func}` computes the rows "
                "past each block's keys on the tiled matmul path")
    return ""

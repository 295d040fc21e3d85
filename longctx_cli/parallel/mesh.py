"""Process groups for data parallel x sequence parallel training, and the SP context.

World ranks are laid out dp-major: the SP group of rank ``r`` is the ``sp`` consecutive ranks
starting at ``r // sp * sp`` (an SP group stays inside a node when ``sp <= nproc_per_node``),
and the DP group of ``r`` is every rank with the same ``r % sp``. With tensor parallelism
(``tp > 1``) the world is the mesh ``(dp, cp, tp)``, tp fastest: TP groups are ``tp``
consecutive ranks (TP moves activations four times per layer, so it gets the closest ranks),
and an SP group is ``sp`` ranks ``tp`` apart; ``tp = 1`` is the layout above.

In hybrid mode an SP group of size ``N`` is split into ``N / U`` Ulysses groups of ``U``
consecutive members, and member ``i`` of every Ulysses group of one SP group forms a ring group.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from longctx_cli.kernel_choice import KernelError, choose_kernel

log = logging.getLogger(__name__)

MODES = ("ring", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "zigzag", "stripe")
# The ring algorithm (Axolotl's `ring_attn_func` names): llama3-style all-gather, or a P2P
# ring whose layout is in its name.
RING_ATTN_FUNCS = ("varlen_llama3", "batch_ring", "batch_zigzag", "batch_stripe")
P2P_LAYOUT = {"batch_ring": "contiguous", "batch_zigzag": "zigzag", "batch_stripe": "stripe"}


@dataclass
class SPContext:
    """Everything a rank needs to know about its SP group; built once per process."""

    sp_group: ProcessGroup | None = None  # None when sp_size == 1
    sp_rank: int = 0
    sp_size: int = 1
    mode: str = "ring"
    layout: str = "contiguous"
    heads_k_stride: int = 1
    kernel: str = "torch"  # resolved: torch | flash | torch_flash, never auto
    ulysses_group: ProcessGroup | None = None  # hybrid only
    ring_group: ProcessGroup | None = None  # hybrid only
    ulysses_degree: int = 1
    ring_attn_func: str = "varlen_llama3"  # see RING_ATTN_FUNCS

    @property
    def p2p(self) -> bool:
        """True when the ring passes K/V blocks point to point (``batch_*``)."""
        return self.ring_attn_func in P2P_LAYOUT
    # parallel.tensor_parallel.TPContext when tensor_parallel_size > 1: rows then pad to a
    # multiple of sp x tp and each TP rank takes the loss of its own slice of the SP shard.
    tp: object | None = None


def flash_available() -> bool:
    """True when CUDA is usable and both flash-attn and ring-flash-attn are installed."""
    if not torch.cuda.is_available():
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "ring_flash_attn"))


def resolve_kernel(
    kernel: str, layout: str = "contiguous", dtype: str | None = None,
    ring_attn_func: str = "varlen_llama3",
) -> str:
    """Turn ``auto`` into a concrete kernel and reject impossible combinations.

    The decision is :func:`longctx_cli.kernel_choice.choose_kernel`'s, as in ``validate``.
    """
    try:
        choice = choose_kernel(
            kernel, layout, cuda=torch.cuda.is_available(), flash_attn=flash_available(),
            dtype=dtype, ring_attn_func=ring_attn_func,
        )
    except KernelError as err:
        raise ValueError(str(err)) from None
    if kernel == "auto":
        log.info("attention_kernel auto -> %s (%s)", choice.kernel, choice.reason)
    return choice.kernel


def check_ring_layout(mode: str, ring_attn_func: str, layout: str) -> None:
    """A P2P ring fixes its layout; the stripe layout exists only for ``batch_stripe``."""
    if ring_attn_func not in RING_ATTN_FUNCS:
        raise ValueError(
            f"unknown ring_attn_func {ring_attn_func!r}; expected one of {RING_ATTN_FUNCS}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sp_sharding {layout!r}; expected one of {LAYOUTS}")
    if mode != "ulysses" and ring_attn_func in P2P_LAYOUT and P2P_LAYOUT[ring_attn_func] != layout:
        raise ValueError(
            f"ring_attn_func {ring_attn_func} runs on sp_sharding "
            f"{P2P_LAYOUT[ring_attn_func]}, not {layout}"
        )
    if layout == "stripe" and (mode != "ring" or ring_attn_func != "batch_stripe"):
        raise ValueError(
            "sp_sharding stripe is computed only by sequence_parallel_mode ring with "
            "ring_attn_func batch_stripe"
        )


def _validate(world_size: int, sp: int, mode: str, ulysses_degree: int | None) -> int:
    if mode not in MODES:
        raise ValueError(f"unknown sequence_parallel_mode {mode!r}; expected one of {MODES}")
    if sp < 1 or world_size % sp != 0:
        raise ValueError(f"world size {world_size} is not a multiple of sp {sp}")
    if mode != "hybrid":
        return 1
    u = ulysses_degree or 1
    if u < 1 or sp % u != 0:
        raise ValueError(f"ulysses_degree {u} must divide sp {sp}")
    return u


def _new_groups(blocks: list[list[int]], rank: int) -> ProcessGroup | None:
    """Create every group (all ranks must call new_group in the same order); return ours."""
    mine = None
    for ranks in blocks:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def build_parallel_groups(
    sp: int = 1,
    mode: str = "ring",
    ulysses_degree: int | None = None,
    layout: str = "contiguous",
    heads_k_stride: int = 1,
    kernel: str = "auto",
    world_size: int | None = None,
    dtype: str | None = None,
    ring_attn_func: str = "varlen_llama3",
    tp: int = 1,
) -> tuple[ProcessGroup | None, SPContext]:
    """Build the dp x sp groups; return ``(dp_group, sp_context)``.

    Works without ``torch.distributed`` initialised (a single process: world 1, no groups).
    A group of size one is returned as ``None``. ``world_size`` defaults to the initialised
    world (or 1). ``dtype`` (the compute dtype's name) lets ``auto`` pick what really runs.
    """
    initialised = dist.is_available() and dist.is_initialized()
    world = world_size or (dist.get_world_size() if initialised else 1)
    rank = dist.get_rank() if initialised else 0
    if initialised and world != dist.get_world_size():
        raise ValueError(f"world_size {world} != initialised world {dist.get_world_size()}")
    if not initialised and world != 1:
        raise ValueError("torch.distributed must be initialised for a world larger than 1")
    if tp < 1 or world % tp:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel_size {tp}")
    u = _validate(world // tp, sp, mode, ulysses_degree)
    check_ring_layout(mode, ring_attn_func, layout)
    dp = world // (sp * tp)
    ctx = SPContext(
        sp_rank=rank // tp % sp,
        sp_size=sp,
        mode=mode,
        layout=layout,
        heads_k_stride=heads_k_stride,
        kernel=resolve_kernel(kernel, layout, dtype, ring_attn_func),
        ulysses_degree=u,
        ring_attn_func=ring_attn_func,
    )
    if not initialised:
        return None, ctx
    # rank = (d * sp + c) * tp + t for data-parallel d, sequence-parallel c, tensor-parallel t.
    sp_blocks = [[(d * sp + c) * tp + t for c in range(sp)] for d in range(dp) for t in range(tp)]
    dp_blocks = [[(d * sp + c) * tp + t for d in range(dp)] for c in range(sp) for t in range(tp)]
    dp_group = _new_groups(dp_blocks, rank) if dp > 1 else None
    if sp > 1:
        ctx.sp_group = _new_groups(sp_blocks, rank)
    if mode == "hybrid" and sp > 1:
        uly_blocks = [blk[j : j + u] for blk in sp_blocks for j in range(0, sp, u)]
        ring_blocks = [blk[i::u] for blk in sp_blocks for i in range(u)]
        ctx.ulysses_group = _new_groups(uly_blocks, rank) if u > 1 else None
        ctx.ring_group = _new_groups(ring_blocks, rank) if sp // u > 1 else None
    return dp_group, ctx


def single_process_context(
    layout: str = "contiguous",
    heads_k_stride: int = 1,
    kernel: str = "torch",
    ring_attn_func: str = "varlen_llama3",
) -> SPContext:
    """An SP context of size one (no communication), e.g. for evaluation or sp=1 training."""
    check_ring_layout("ring", ring_attn_func, layout)
    return SPContext(
        layout=layout,
        heads_k_stride=heads_k_stride,
        kernel=resolve_kernel(kernel),  # one process: the layout never reaches a kernel
        ring_attn_func=ring_attn_func,
    )

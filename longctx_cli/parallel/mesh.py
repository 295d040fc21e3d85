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

log = logging.getLogger(__name__)

MODES = ("ring", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "zigzag")
KERNELS = ("auto", "torch", "flash")


@dataclass
class SPContext:
    """Everything a rank needs to know about its SP group; built once per process."""

    sp_group: ProcessGroup | None = None  # None when sp_size == 1
    sp_rank: int = 0
    sp_size: int = 1
    mode: str = "ring"
    layout: str = "contiguous"
    heads_k_stride: int = 1
    kernel: str = "torch"  # resolved: torch | flash, never auto
    ulysses_group: ProcessGroup | None = None  # hybrid only
    ring_group: ProcessGroup | None = None  # hybrid only
    ulysses_degree: int = 1
    # parallel.tensor_parallel.TPContext when tensor_parallel_size > 1: rows then pad to a
    # multiple of sp x tp and each TP rank takes the loss of its own slice of the SP shard.
    tp: object | None = None


def flash_available() -> bool:
    """True when CUDA is usable and both flash-attn and ring-flash-attn are installed."""
    if not torch.cuda.is_available():
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "ring_flash_attn"))


def resolve_kernel(kernel: str, layout: str = "contiguous") -> str:
    """Turn ``auto`` into a concrete kernel and reject impossible combinations."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "auto":
        # The flash adapter only supports the contiguous layout ring-flash-attn expects.
        chosen = "flash" if layout == "contiguous" and flash_available() else "torch"
        log.info("attention_kernel auto -> %s", chosen)
        return chosen
    if kernel == "flash" and layout != "contiguous":
        raise ValueError("the flash kernel needs sp_sharding: contiguous (zigzag is torch only)")
    return kernel


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
    tp: int = 1,
) -> tuple[ProcessGroup | None, SPContext]:
    """Build the dp x sp groups; return ``(dp_group, sp_context)``.

    Works without ``torch.distributed`` initialised (a single process: world 1, no groups).
    A group of size one is returned as ``None``. ``world_size`` defaults to the initialised
    world (or 1).
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
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sp_sharding {layout!r}; expected one of {LAYOUTS}")
    dp = world // (sp * tp)
    ctx = SPContext(
        sp_rank=rank // tp % sp,
        sp_size=sp,
        mode=mode,
        layout=layout,
        heads_k_stride=heads_k_stride,
        kernel=resolve_kernel(kernel, layout),
        ulysses_degree=u,
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
    layout: str = "contiguous", heads_k_stride: int = 1, kernel: str = "torch"
) -> SPContext:
    """An SP context of size one (no communication), e.g. for evaluation or sp=1 training."""
    return SPContext(layout=layout, heads_k_stride=heads_k_stride, kernel=resolve_kernel(kernel))

"""Layouts and parallel states for tests, in the terms the tests speak (sp, mode, sharding).

``sp_state(...)`` builds this process group's state (a collective, like every rank does at
start-up): the data-parallel degree fills the initialised world. ``rank_state(r, ...)`` is the
state of SP rank ``r`` without process groups (for sharding arithmetic in one process).
"""

from __future__ import annotations

import torch.distributed as dist

from longctx_cli.layout import P2P_SHARDING, Layout
from longctx_cli.parallel.mesh import ParallelState, build_parallel_state


def layout_of(
    sp: int = 1,
    mode: str = "ring",
    ulysses_degree: int | None = None,
    layout: str | None = None,
    heads_k_stride: int = 1,
    kernel: str = "torch",
    ring_attn_func: str | None = None,
    tp: int = 1,
    world: int | None = None,
    head_chunks: int = 1,
) -> Layout:
    if ring_attn_func is None:  # stripe exists only for its P2P ring
        ring_attn_func = "batch_stripe" if layout == "stripe" else "varlen_llama3"
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else sp * tp
    return Layout.filling(
        world, sp=sp, tp=tp, mode=mode,
        ulysses=ulysses_degree if mode == "hybrid" else 0,
        sharding=layout or P2P_SHARDING.get(ring_attn_func, "contiguous"),
        ring_attn_func=ring_attn_func, heads_k_stride=heads_k_stride, head_chunks=head_chunks,
        kernel="torch" if kernel == "auto" else kernel,
    )


def sp_state(**kwargs) -> ParallelState:
    return build_parallel_state(layout_of(**kwargs))


def rank_state(sp_rank: int = 0, sp_size: int = 1, **kwargs) -> ParallelState:
    return ParallelState(layout_of(sp=sp_size, world=sp_size * kwargs.get("tp", 1), **kwargs),
                         sp_rank=sp_rank)

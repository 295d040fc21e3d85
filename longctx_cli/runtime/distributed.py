"""Joining the torchrun job and the parallel layout each rank works in (train and eval)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.config.rules import hsdp_replicas
from longctx_cli.data.prepare import prepare
from longctx_cli.parallel.mesh import SPContext, build_parallel_groups


@dataclass
class Parallel:
    sp_ctx: SPContext
    dp_rank: int
    dp_size: int
    world_mesh: object | None  # DeviceMesh FSDP2 shards over (the world, or dp x cp with TP)
    tp: object | None = None  # parallel.tensor_parallel.TPContext when tensor_parallel_size > 1


@dataclass(frozen=True)
class RankContext:
    """Where this process works, built once per process: its SP context, its data-parallel
    index and count, the id its rows are padded with, its device."""

    sp_ctx: SPContext
    dp_rank: int
    dp_size: int
    pad_id: int
    device: torch.device


def rank_context(parallel: Parallel, pad_id: int, device: torch.device) -> RankContext:
    return RankContext(parallel.sp_ctx, parallel.dp_rank, parallel.dp_size, pad_id, device)


def init_distributed(config: Config) -> torch.device:
    """Join the torchrun job; bounded collective timeouts turn a dead peer into an error."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = bool(config.tf32)  # Axolotl's `tf32`
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def init_parallel(config: Config, device: torch.device) -> Parallel:
    world, sp = dist.get_world_size(), config.sequence_parallel_degree
    tp = config.tensor_parallel_size
    _, ctx = build_parallel_groups(
        sp=sp,
        mode=config.sequence_parallel_mode,
        ulysses_degree=config.ulysses_degree,
        layout=config.sp_sharding,
        heads_k_stride=config.heads_k_stride,
        kernel=config.attention_kernel,
        dtype=config.dtype,
        ring_attn_func=config.ring_attn_func,
        tp=tp,
    )
    if tp > 1:
        from longctx_cli.parallel.tensor_parallel import build_tp_mesh

        ctx.tp = build_tp_mesh(world // (sp * tp), sp, tp, device.type)
        mesh = ctx.tp.fsdp_mesh if config.fsdp and world > tp else None
        return Parallel(ctx, dist.get_rank() // (sp * tp), world // (sp * tp), mesh, ctx.tp)
    mesh = None
    if config.fsdp and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        replicas = hsdp_replicas(config)
        # HSDP (dp_replicate_size > 1): shard within groups, replicate across them.
        mesh = (init_device_mesh(device.type, (replicas, world // replicas))
                if replicas > 1 else init_device_mesh(device.type, (world,)))
    return Parallel(ctx, dist.get_rank() // sp, world // sp, mesh)


def load_rows(config: Config, tokenizer):
    """Rank 0 builds (or reuses) the cache first; the others then read it."""
    if dist.get_rank() == 0:
        prepared = prepare(config, tokenizer, progress=True)
    dist.barrier()
    if dist.get_rank() != 0:
        prepared = prepare(config, tokenizer, progress=False)
    return prepared.train, prepared.eval

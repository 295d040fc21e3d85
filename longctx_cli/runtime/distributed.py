"""Joining the torchrun job and the parallel state each rank works in (train and eval)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.rules import layout_for
from longctx_cli.config.world import Platform
from longctx_cli.data.prepare import prepare
from longctx_cli.parallel.mesh import ParallelState, build_parallel_state


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


def init_parallel(config: Config, device: torch.device) -> ParallelState:
    """This rank's place in the run: the plan's :class:`Layout` for the torchrun world (the
    one `validate` prints), and the process groups built from it. A collective."""
    layout = layout_for(config, dist.get_world_size(), Platform.detect(), "the torchrun world",
                        read_model_config(config))
    return build_parallel_state(layout, device)


def load_rows(config: Config, tokenizer):
    """Rank 0 builds (or reuses) the cache first; the others then read it."""
    if dist.get_rank() == 0:
        prepared = prepare(config, tokenizer, progress=True)
    dist.barrier()
    if dist.get_rank() != 0:
        prepared = prepare(config, tokenizer, progress=False)
    return prepared.train, prepared.eval

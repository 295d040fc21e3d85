"""How many ranks a run has; what the machine offers is `kernel_choice.Platform`.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from longctx_cli.config.schema import Config
from longctx_cli.errors import UserError
from longctx_cli.kernel_choice import Platform

__all__ = ["Platform", "resolve_world", "resolve_world_size"]

if TYPE_CHECKING:
    pass

# ---- world size and platform ------------------------------------------------------------


def resolve_world(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> tuple[int, str]:
    """World size and where it came from: flags, else torchrun's WORLD_SIZE, else the config."""
    if nproc_per_node is not None:
        nodes = nnodes or 1
        return nproc_per_node * nodes, f"--nproc-per-node {nproc_per_node} x --nnodes {nodes}"
    if nnodes is not None:
        raise UserError(
            f"--nnodes {nnodes} was given without --nproc-per-node.",
            fix="also pass --nproc-per-node (ranks per node), "
            "e.g. `--nproc-per-node 8 --nnodes 2`.",
        )
    env = os.environ.get("WORLD_SIZE")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UserError(
                f"the environment variable WORLD_SIZE = {env!r} is not a positive integer.",
                fix="unset it or pass --nproc-per-node.",
            )
        return int(env), "WORLD_SIZE from the environment"
    if config.parallel.world_size is not None:
        return config.parallel.world_size, "`world_size` in the config"
    return 1, "default (no --nproc-per-node, WORLD_SIZE or `world_size`)"


def resolve_world_size(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> int:
    """World size: flags, else torchrun's WORLD_SIZE, else `config.parallel.world_size`, else 1."""
    return resolve_world(config, nproc_per_node, nnodes)[0]

"""How many ranks a run has and what the machine offers (GPUs, ring_flash_attn).

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config.schema import Config
from longctx_cli.errors import UserError

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
    if config.world_size is not None:
        return config.world_size, "`world_size` in the config"
    return 1, "default (no --nproc-per-node, WORLD_SIZE or `world_size`)"


def resolve_world_size(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> int:
    """World size: flags, else torchrun's WORLD_SIZE, else `config.world_size`, else 1."""
    return resolve_world(config, nproc_per_node, nnodes)[0]


@dataclass(frozen=True)
class Platform:
    """What the machine running `validate` offers; tests pass their own."""

    cuda: bool
    ring_flash_attn: bool

    @classmethod
    def detect(cls) -> Platform:
        if not _torch_may_have_gpu():
            return cls(cuda=False, ring_flash_attn=False)
        import torch

        cuda = torch.cuda.is_available()
        # ring_flash_attn imports flash_attn (CUDA only) at import time: try it only on CUDA.
        return cls(cuda=cuda, ring_flash_attn=cuda and _importable("ring_flash_attn"))


def _torch_may_have_gpu() -> bool:
    """False for a CPU-only torch build, read from its version.py without importing torch
    (~1-2 s), so `validate` answers at once on a laptop; True (ask torch) otherwise."""
    import importlib.util
    import sys

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


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # flash_attn can fail with OSError/RuntimeError on a broken CUDA setup
        return False
    return True

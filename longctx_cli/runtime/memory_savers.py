"""Memory options of a run: tiled MLP and activation offloading.

`apply_tiled_mlp(model, tiles)` makes every decoder layer's MLP run over its tokens in tiles,
each tile under non-reentrant activation checkpointing, so the `[tokens, intermediate_size]`
intermediates exist one tile at a time in forward and in backward. Gradients are exact: the
MLP acts on every token independently, so a tile computes exactly the rows of the whole.

`activation_offload()` keeps the tensors autograd saves for backward in host memory while it
is active and brings them back when backward needs them. Combined with gradient
checkpointing, what is saved outside the recomputed regions is each layer's input
`[tokens, hidden]`, so the device keeps about one layer's activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longctx_cli.runtime.head import decoder_of

_TILED_MARK = "_longctx_tiled_mlp"


def tile_count(tokens: int, hidden_size: int, tiles: int | None) -> int:
    """Tiles for `tokens` rows: `tiles` if given, else about one tile per `hidden_size` tokens.

    With tiles of ~hidden_size tokens a tile's intermediates (`hidden x intermediate`) are no
    larger than one MLP weight, so they stop mattering once the row is long.
    """
    wanted = tiles if tiles is not None else math.ceil(tokens / max(1, hidden_size))
    return max(1, min(tokens, wanted))


def tiled_mlp_forward(
    mlp_forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tiles: int | None,
) -> torch.Tensor:
    """`mlp_forward(x)` computed over the token dimension (-2) in tiles.

    Under autograd each tile is checkpointed: forward keeps only the tile's input, backward
    recomputes one tile at a time. `torch.split` (not slicing) means the input gradient is
    assembled by one concatenation instead of a zero-filled full-size tensor per tile.
    """
    n = tile_count(x.shape[-2], x.shape[-1], tiles)
    if n == 1:
        return mlp_forward(x)
    chunks = torch.split(x, math.ceil(x.shape[-2] / n), dim=-2)
    if not torch.is_grad_enabled():
        return torch.cat([mlp_forward(c) for c in chunks], dim=-2)
    outs = [checkpoint(mlp_forward, c, use_reentrant=False) for c in chunks]
    return torch.cat(outs, dim=-2)


def _mlps(model: nn.Module) -> list[nn.Module]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(decoder_of(base), "layers", None)
    if layers is None:
        raise ValueError("the model's decoder has no `layers`: tiled_mlp cannot find its MLPs")
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if any(m is None for m in mlps):
        raise ValueError("a decoder layer has no `mlp` module: tiled_mlp cannot wrap it")
    return mlps


def apply_tiled_mlp(model: nn.Module, tiles: int | None) -> None:
    """Make every decoder layer's MLP run tiled (see module doc); idempotent.

    The MLP module stays where it is and only its `forward` is replaced on the instance:
    wrapping it in another module would rename its parameters (`mlp.mlp.gate_proj`), and
    checkpoints and the exported `final/` model must keep the plain transformers names.
    LoRA layers and FSDP2 hooks live on the linear/decoder-layer modules, so both keep
    working unchanged inside each tile.
    """
    for mlp in _mlps(model):
        if getattr(mlp, _TILED_MARK, False):
            continue
        plain = mlp.forward  # bound method of the original class

        def forward(x: torch.Tensor, _plain: Callable = plain) -> torch.Tensor:
            return tiled_mlp_forward(_plain, x, tiles)

        mlp.forward = forward
        setattr(mlp, _TILED_MARK, True)


@dataclass
class OffloadStats:
    """Bytes the offload hooks handled (tensors already in host memory count as `in_host`)."""

    offloaded: int = 0
    in_host: int = 0
    tensors: int = 0


def _is_weight(t: torch.Tensor) -> bool:
    # Weights saved for backward live for the whole step anyway: copying them out saves nothing.
    # Linear layers save a transposed view of the weight, so look through views too.
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


@contextmanager
def activation_offload(
    enabled: bool = True, stats: OffloadStats | None = None
) -> Iterator[OffloadStats]:
    """Keep saved activations in host memory (pinned on CUDA) while the block runs.

    Use it around each micro-batch's forward *and* backward, with gradient checkpointing on.
    Tensors already on the CPU stay where they are (there is no memory to move them to), so
    on a CPU-only run this changes nothing but still counts what it would move in `stats`.
    """
    stats = stats if stats is not None else OffloadStats()
    if not enabled:
        yield stats
        return
    pin = torch.cuda.is_available()

    def pack(t: torch.Tensor) -> Any:
        if _is_weight(t):
            return t
        stats.tensors += 1
        size = t.numel() * t.element_size()
        if t.device.type == "cpu":
            stats.in_host += size
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        stats.offloaded += size
        return (t.device, host)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=pin)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats

"""Memory options of a run: tiled MLP, activation offloading and the lean RMSNorm.

`apply_tiled_mlp(model, tiles)` makes every decoder layer's MLP run over its tokens in tiles,
each tile under non-reentrant activation checkpointing, so the `[tokens, intermediate_size]`
intermediates exist one tile at a time in forward and in backward. Gradients are exact: the
MLP acts on every token independently, so a tile computes exactly the rows of the whole.

`activation_offload()` keeps the tensors autograd saves for backward in host memory while it
is active and brings them back when backward needs them. Combined with gradient
checkpointing, what is saved outside the recomputed regions is each layer's input
`[tokens, hidden]`, so the device keeps about one layer's activations.

`apply_lean_rms_norm(model)` (always on in training, `runtime/model.py`) makes every
Llama-style RMSNorm compute through `LeanRMSNorm`: the same forward ops in the same order
(bit-identical output), but autograd keeps only the input as given and a float32 `rstd` per
row instead of a float32 copy of the input and the normalized tensor, and backward computes
the analytic gradient over the rows in chunks, so its float32 temporaries are one chunk's
(`LEAN_NORM_CHUNK_BYTES`) instead of several `[tokens, hidden]` tensors.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from longctx_cli.constants import (
    LEAN_NORM_CHUNK_BYTES,
    LEAN_NORM_CHUNK_TENSORS,
    LEAN_NORM_MIN_CHUNKS,
)
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


# ---- lean RMSNorm ------------------------------------------------------------------------

# `LlamaRMSNorm.forward` (transformers 5.24, modeling_llama.py): a norm class whose forward is
# this code, up to formatting, comments, docstring and annotations, computes what LeanRMSNorm
# computes. Written out here so a change in transformers cannot silently change what matches.
LLAMA_RMS_NORM_FORWARD = """
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_LEAN_MARK = "_longctx_lean_rms_norm"


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LlamaRMSNorm's output, the float32 rstd per row): its ops in its order, so the output
    is bit for bit the module's own."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    hidden_states = hidden_states * rstd
    return weight * hidden_states.to(input_dtype), rstd


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last dim]: a view where the strides allow it (always for the contiguous
    tensors a norm sees in training), else a copy."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


class LeanRMSNorm(torch.autograd.Function):
    """LlamaRMSNorm with a lean backward: forward saves only the input as given, the weight
    and the float32 `rstd` per row; backward computes, per chunk of rows, with
    n = x_f * rstd and gn = g * w in float32,

        grad_x = rstd * gn - x_f * rstd^3 * mean(gn * x_f, -1)
        grad_w = sum over rows of g * n.to(x.dtype)   (accumulated in float32)

    writing each chunk's grad_x into one preallocated tensor (the only full-size allocation,
    unless the incoming gradient cannot be viewed as rows: `_as_rows` then copies it).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                chunk_bytes: int) -> torch.Tensor:
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.chunk_bytes = chunk_bytes
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        hidden = x.shape[-1]
        xs, gs, rs = _as_rows(x), _as_rows(grad_out), rstd.reshape(-1, 1)
        rows = xs.shape[0]
        step = max(1, min(ctx.chunk_bytes // (LEAN_NORM_CHUNK_TENSORS * 4 * hidden),
                          -(-rows // LEAN_NORM_MIN_CHUNKS)))
        grad_x = torch.empty((rows, hidden), dtype=x.dtype, device=x.device) if need_x else None
        grad_w = torch.zeros(hidden, dtype=torch.float32, device=x.device) if need_w else None
        w32 = weight.to(torch.float32)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            _backward_chunk(xs[part], gs[part], rs[part], w32,
                            grad_x[part] if grad_x is not None else None, grad_w)
        return (grad_x.view(x.shape) if grad_x is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None, None, None)


def _backward_chunk(x: torch.Tensor, g: torch.Tensor, r: torch.Tensor, w32: torch.Tensor,
                    grad_x: torch.Tensor | None, grad_w: torch.Tensor | None) -> None:
    """One chunk of rows of `LeanRMSNorm.backward`: writes `grad_x`, adds into `grad_w`
    (float32). A function of its own so the chunk's temporaries die before the next chunk's
    (at most LEAN_NORM_CHUNK_TENSORS float32 [rows, hidden] tensors at once)."""
    xf = x.to(torch.float32)  # a view when x is float32
    if grad_w is not None:
        # The forward multiplied the weight by n rounded to the input dtype (rounded as the
        # product is written, as `(xf * r).to(x.dtype)` rounds it).
        rounded = torch.empty(xf.shape, dtype=x.dtype, device=x.device)
        n = torch.mul(xf, r, out=rounded).to(torch.float32)
        del rounded
        grad_w += n.mul_(g).sum(0)
        del n
    if grad_x is not None:
        # rstd * gn - x_f * rstd^3 * mean(gn * x_f) as rstd * (gn - x_f * rstd^2 * mean(...)):
        # the last multiply writes grad_x's dtype directly (one pass less than a copy).
        gn = torch.mul(g, w32).to(torch.float32)
        coef = (gn * xf).mean(-1, keepdim=True).mul_(r * r)
        torch.mul(gn.addcmul_(xf, coef, value=-1), r, out=grad_x)


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  chunk_bytes: int = LEAN_NORM_CHUNK_BYTES) -> torch.Tensor:
    """LlamaRMSNorm's output (bit for bit) through `LeanRMSNorm` when autograd needs it;
    `chunk_bytes`: the float32 temporaries of one backward chunk."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LeanRMSNorm.apply(x, weight, eps, chunk_bytes)
    return _rms_norm(x, weight, eps)[0]


def _normalized_forward(source: str) -> str | None:
    """The function in `source` as the parser sees it: no comments, docstring, annotations
    or formatting (None: not one plain undecorated function)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    fn = tree.body[0]
    if fn.decorator_list:
        return None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        fn.body = body[1:] or [ast.Pass()]
    args = fn.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    fn.returns = None
    return ast.unparse(fn)


_REFERENCE = _normalized_forward(LLAMA_RMS_NORM_FORWARD)


@functools.cache  # once per norm class: reading and parsing its source is not free
def _forward_matches(forward: Callable) -> bool:
    """Does this class's `forward` compute LlamaRMSNorm's formula (same code)?"""
    # A plain function only: a wrapped one's source (inspect unwraps) is not what runs.
    plain = inspect.isfunction(forward) and not hasattr(forward, "__wrapped__")
    try:
        source = inspect.getsource(forward) if plain else None
    except (OSError, TypeError):
        source = None
    return source is not None and _normalized_forward(source) == _REFERENCE


def is_llama_rms_norm(module: nn.Module) -> bool:
    """`module` is a norm whose class computes LlamaRMSNorm's formula, with a 1-D weight
    parameter (not a DTensor: TP keeps it one in forward) and a float epsilon, and whose
    `forward` nobody replaced on the instance."""
    weight = module._parameters.get("weight")
    eps = getattr(module, "variance_epsilon", None)
    if weight is None or weight.dim() != 1 or isinstance(weight, DTensor):
        return False
    if not isinstance(eps, float) or "forward" in vars(module):
        return False
    return _forward_matches(type(module).forward)


def _lean_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return lean_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def apply_lean_rms_norm(model: nn.Module) -> int:
    """Make every Llama-style RMSNorm of `model` (`is_llama_rms_norm`) compute through
    `LeanRMSNorm`; returns how many modules changed (0 on a second call).

    Only the instance's `forward` is replaced (parameter names, checkpoints and the classes
    stay as transformers made them), bound to the module with `MethodType` so a deep copy of
    the module (peft's `modules_to_save`) calls its own weight, not the original's.
    """
    changed = 0
    for module in model.modules():
        if is_llama_rms_norm(module):
            module.forward = types.MethodType(_lean_forward, module)
            setattr(module, _LEAN_MARK, True)
            changed += 1
    return changed


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

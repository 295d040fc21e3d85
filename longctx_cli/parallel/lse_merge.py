"""Partial attention results merged through their log-sum-exp, and attention sinks.

Attention over disjoint key sets merges exactly: ``lse = logaddexp(l1, l2)``,
``out = o1 exp(l1 - lse) + o2 exp(l2 - lse)`` (:func:`merge_f32`). The block backward run
with the merged ``out``/``lse`` is then exact for every block. Attention sinks (a per-head
logit with no value) join after all keys are merged: ``lse' = logaddexp(lse, sink)``,
``out' = out * exp(lse - lse')`` (:func:`apply_sinks`); :func:`sink_grad` gives d sink.
Statistics and merges are float32 whatever the inputs (:func:`float32_inside`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def float32_inside(fn: _F) -> _F:
    """Run ``fn`` with autocast off on its tensors' device: the kernels compute scores,
    softmax statistics and accumulations in float32 themselves (``.float()``), and an
    enclosing fp16/bf16 autocast would silently run those matmuls in half precision."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def out_like(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None,
             fill: float | None = None) -> torch.Tensor:
    """An attention output buffer: q's rows and heads, v's head dim (MLA: they differ)."""
    shape = (*q.shape[:-1], v.shape[-1])
    dtype = dtype or q.dtype
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=q.device)
    return torch.full(shape, fill, dtype=dtype, device=q.device)


def merge_f32(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets (float32)."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(lse.isinf(), 0.0, lse)  # rows no key reached so far stay at 0
    out = o1 * torch.exp(l1 - safe).unsqueeze(-1) + o2 * torch.exp(l2 - safe).unsqueeze(-1)
    return out, lse


@float32_inside
def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one value-less key of logit ``sinks[h]`` to every row's softmax.

    out ``[L, H, D]``, lse ``[H, L]`` float32, sinks ``[H]`` -> the same shapes, renormalised.
    """
    new_lse = torch.logaddexp(lse, sinks.detach().float()[:, None])
    weight = torch.exp(lse - new_lse).transpose(0, 1).unsqueeze(-1)
    return (out.float() * weight).to(out.dtype), new_lse


@float32_inside
def sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """d loss / d sinks, from the renormalised ``out``/``lse``: ``-sum_t P(sink) (dout . out)``."""
    rowdot = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [H, L]
    p_sink = torch.exp(sinks.detach().float()[:, None] - lse)
    return (-(p_sink * rowdot).sum(-1)).to(sinks.dtype)

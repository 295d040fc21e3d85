"""The row's SP metadata carried to attention modules whose layer does not pass it on.

transformers hands the keyword arguments of a model's forward down to each attention
function, which is how `sp_meta` reaches longctx's attention. A few families' decoder layers
call their attention without them (Nemotron, StableLM: `self.self_attn(hidden_states=...,
position_embeddings=...)`), so the attention would run without the row's layout and fail.
Forward pre-hooks on the model's own modules, nothing replaced: the layer's hook keeps the
`sp_meta` it was called with, and its attention's hook adds it where the call lacks one.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class _Slot:
    """The metadata a layer was last called with, for its attention."""

    def __init__(self) -> None:
        self.meta: Any = None

    def keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.meta = kwargs.get("sp_meta")

    def give(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.meta is None or kwargs.get("sp_meta") is not None:
            return None
        return args, {**kwargs, "sp_meta": self.meta}


def relay_sp_meta(model: nn.Module) -> list[Any]:
    """Hooks on every module holding an attention child (a child whose class name ends in
    `Attention` and that knows its `layer_idx`, as transformers' attention modules do);
    returns their handles."""
    handles = []
    for parent in model.modules():
        for child in parent.children():
            if type(child).__name__.endswith("Attention") and hasattr(child, "layer_idx"):
                slot = _Slot()
                handles.append(parent.register_forward_pre_hook(slot.keep, with_kwargs=True))
                handles.append(child.register_forward_pre_hook(slot.give, with_kwargs=True))
    return handles

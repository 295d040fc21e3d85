"""How a decoder's forward is handed a KV cache (its argument's name changed in transformers)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_kwargs(decoder: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand `cache` to the decoder's forward.

    transformers renamed the decoder's `past_key_values` argument to `cache` (5.2x; the
    old name warns until it is removed), so the name is read off the forward's signature.
    Without a cache, `use_cache=False`: a training or scoring forward keeps no cache (models
    otherwise build one by default, and a hybrid model whose tiny copy has only scan layers
    cannot).
    """
    params = inspect.signature(decoder.forward).parameters
    if cache is None:
        return {"use_cache": False} if "use_cache" in params else {}
    name = "cache" if "cache" in params else "past_key_values"
    return {name: cache, "use_cache": True}

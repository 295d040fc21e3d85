"""What one attention call computes besides q, k and v: the layer's features and the
segments of a row. Shared by the kernels (:mod:`.torch_kernel`, :mod:`.torch_flash`) and the
strategies, so that no kernel module imports another for its types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class AttentionFeatures:
    """How one layer's attention scores keys, beyond the document-causal mask.

    ``scale`` multiplies ``q . k``; ``window`` (a query at position ``p`` sees keys
    ``p - window + 1 .. p``, as transformers' sliding-window masks do) or ``None``;
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax;
    ``chunk`` (chunked local attention, Llama 4): a query at in-document position ``p`` sees
    keys of its document at positions ``floor(p / chunk) * chunk .. p``, as the model's own
    forward over the document alone does. Kernels never see it: :func:`.attention.sp_attention`
    turns chunk boundaries into segment starts (:func:`.sharding.chunked_meta`).
    ``spent``: the caller reads q, k and v no more after the call, so a strategy may write
    over them (:func:`.attention.longctx_attention_forward` says when; autograd's version
    counter still guards any saved use): Ulysses writes its exchange and gradients there,
    the llama3 ring its gradients (:func:`writable_inputs`).
    ``dropout``: the probability with which the layer drops each attention probability in
    training (transformers passes 0 in eval); only :mod:`.dropout`'s whole-row paths apply it.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    chunk: int | None = None
    spent: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ValueError(f"attention dropout must be in [0, 1), got {self.dropout}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be positive, got {self.softcap}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"attention chunk must be at least 1 token, got {self.chunk}")


def owns_dense_storage(x: torch.Tensor) -> bool:
    """Whether ``[L, H, D]`` ``x`` is the whole of its storage, token- or heads-major."""
    dense = x.is_contiguous() or x.transpose(0, 1).is_contiguous()
    return dense and x.untyped_storage().nbytes() == x.numel() * x.element_size()


def writable_inputs(feats: AttentionFeatures, *tensors: torch.Tensor) -> bool:
    """Whether a strategy's backward may write gradients over ``tensors``' own memory: the
    caller handed them over spent, no two share memory, and each is the whole of its
    storage (a view into a larger tensor may have other readers)."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return (feats.spent and len(storages) == len(tensors)
            and all(owns_dense_storage(t) for t in tensors))


def as_features(features: AttentionFeatures | float) -> AttentionFeatures:
    """A bare number is a plain scale (the pre-features call signature)."""
    if isinstance(features, AttentionFeatures):
        return features
    return AttentionFeatures(scale=float(features))


class Segment(NamedTuple):
    """Queries ``q[q_start:q_end]`` attend to keys ``k[k_start:k_end]`` (bottom-right causal)
    and, for a document that branches off a shared prefix (`SPMeta.prefixes`), to every key
    of ``k[p_start:p_end]`` as well.

    ``bidirectional``: the queries are one image's tokens (`SPMeta.bidirectional`), which see
    every key up to ``k_end`` whatever their own position; a window still counts back from
    each query's position (``k_end - (q_end - row)``, as for a causal segment).
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    p_start: int = 0
    p_end: int = 0
    bidirectional: bool = False

    @property
    def has_prefix(self) -> bool:
        return self.p_end > self.p_start

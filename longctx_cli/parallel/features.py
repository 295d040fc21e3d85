"""What one attention call computes besides q, k and v: the layer's features and the
segments of a row. Shared by the kernels (:mod:`.kernels`, :mod:`.torch_flash`) and the
strategies, so that no kernel module imports another for its types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class AttentionFeatures:
    """How one layer's attention scores keys, beyond the document-causal mask.

    ``scale`` multiplies ``q . k``; ``window`` (a query at position ``p`` sees keys
    ``p - window + 1 .. p``, as transformers' sliding-window masks do) or ``None``;
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be positive, got {self.softcap}")


def as_features(features: AttentionFeatures | float) -> AttentionFeatures:
    """A bare number is a plain scale (the pre-features call signature)."""
    if isinstance(features, AttentionFeatures):
        return features
    return AttentionFeatures(scale=float(features))


class Segment(NamedTuple):
    """Queries ``q[q_start:q_end]`` attend to keys ``k[k_start:k_end]`` (bottom-right causal)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int

"""The model's head: `lm_head` followed by the family's own logit transform.

`XForCausalLM.forward` does more than `lm_head(hidden)` in several families: it divides by
`logits_scaling` (Granite), multiplies by `logit_scale` (Cohere), squashes with
`final_logit_softcapping` (Gemma 2/3). The trainer and every evaluation compute logits from
hidden states themselves (in token chunks, on this rank's slice), so they must apply the same
transform, or they train and score a different model. This module is the one place that does
it; the transform is read from the model config's attributes, never from the family's name.
A transform not listed here is caught by the fidelity probe (`train/fidelity.py`), which
compares this head against the model's own forward before training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longctx_cli.constants import LOGIT_TRANSFORM_KEYS


@dataclass(frozen=True)
class LogitTransform:
    """What a family applies to `lm_head`'s output: `softcap(logits * multiplier)`."""

    multiplier: float = 1.0  # logit_scale, or 1 / logits_scaling
    softcap: float | None = None  # final_logit_softcapping: cap * tanh(logits / cap)

    @classmethod
    def from_config(cls, model_config: object) -> LogitTransform:
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else (
            model_config)
        multiplier = 1.0
        # Cohere: `logits * logit_scale`; Granite: `logits / logits_scaling`; Gemma: softcap.
        scale_key, divisor_key, softcap_key = LOGIT_TRANSFORM_KEYS
        scale = getattr(text, scale_key, None)
        if scale is not None:
            multiplier *= float(scale)
        divisor = getattr(text, divisor_key, None)
        if divisor is not None:
            multiplier /= float(divisor)
        softcap = getattr(text, softcap_key, None)
        return cls(multiplier, float(softcap) if softcap else None)

    @property
    def is_identity(self) -> bool:
        return self.multiplier == 1.0 and self.softcap is None

    def describe(self) -> str:
        parts = []
        if self.multiplier != 1.0:
            parts.append(f"logits x {self.multiplier:g}")
        if self.softcap is not None:
            parts.append(f"final softcap {self.softcap:g}")
        return ", ".join(parts) or "none"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap is not None:
            # The same three operations as the families' forward, in the same order.
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ModelHead(nn.Module):
    """`lm_head` + the family's logit transform; returns float32 logits `[tokens, vocab]`."""

    def __init__(self, lm_head: nn.Module, transform: LogitTransform):
        super().__init__()
        self.lm_head = lm_head
        self.transform = transform

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform.apply(self.lm_head(hidden).float())


def model_head(lm_head: nn.Module, model_config: object) -> ModelHead:
    """The head a run must use for loss and scoring of a model with this config."""
    return ModelHead(lm_head, LogitTransform.from_config(model_config))


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (it returns `last_hidden_state`), the other half of
    the head/decoder split.

    `PreTrainedModel.get_decoder` looks the decoder up through `base_model_prefix`; a family
    whose prefix does not name the attribute holding its decoder (Llama 4's text model:
    prefix `language_model`, decoder at `model`) gets the causal LM itself back, whose output
    has logits but no `last_hidden_state`. The conventional `model` attribute is its decoder.
    """
    decoder = model.get_decoder()
    if decoder is model:
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module) and inner is not model:
            return inner
    return decoder

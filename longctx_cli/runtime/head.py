"""The model's head: `lm_head` followed by the family's own logit transform.

`XForCausalLM.forward` does more than `lm_head(hidden)` in several families: it divides by
`logits_scaling` (Granite), multiplies by `logit_scale` (Cohere), squashes with
`final_logit_softcapping` (Gemma 2/3). The trainer and every evaluation compute logits from
hidden states themselves (in token chunks, on this rank's slice), so they must apply the same
transform, or they train and score a different model. This module is the one place that does
it; the transform is read from the model config's attributes, never from the family's name.
A transform not listed here is caught by the fidelity probe (`checks/fidelity.py`), which
compares this head against the model's own forward before training.

`cast_head_to_float32` (TRL's `cast_lm_head_to_fp32`) keeps `lm_head`'s weights in float32
and marks the module, so that every head built from it (`model_head`: scoring, the reference
pass, sampling) computes its logits in float32 from float32 hidden states, outside autocast.
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


# Set on an `lm_head` whose weights `cast_head_to_float32` made float32.
_FLOAT32_MARK = "_longctx_float32_head"


class ModelHead(nn.Module):
    """`lm_head` + the family's logit transform; returns float32 logits `[tokens, vocab]`
    (`float32`: the projection itself in float32, from float32 hidden states)."""

    def __init__(self, lm_head: nn.Module, transform: LogitTransform, float32: bool = False):
        super().__init__()
        self.lm_head = lm_head
        self.transform = transform
        self.float32 = float32

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.float32:  # autocast would run the matmul in its low precision again
            with torch.autocast(hidden.device.type, enabled=False):
                return self.transform.apply(self.lm_head(hidden.float()).float())
        return self.transform.apply(self.lm_head(hidden).float())


def is_float32_head(lm_head: nn.Module) -> bool:
    """Whether `cast_head_to_float32` made this head (or the layer a LoRA wraps) float32."""
    return bool(getattr(lm_head, _FLOAT32_MARK, False)
                or getattr(getattr(lm_head, "base_layer", None), _FLOAT32_MARK, False))


def model_head(lm_head: nn.Module, model_config: object) -> ModelHead:
    """The head a run must use for loss, scoring and sampling of a model with this config."""
    return ModelHead(lm_head, LogitTransform.from_config(model_config),
                     float32=is_float32_head(lm_head))


def cast_head_to_float32(model: nn.Module) -> None:
    """TRL's `cast_lm_head_to_fp32` on a transformers causal LM, before TP and FSDP shard it
    (they keep views of each parameter's storage): `lm_head`'s parameters become float32 and
    every `model_head` of it computes in float32. With tied embeddings the shared weight is
    float32 too, and the embedding's output is cast back to the decoder's dtype, as TRL does."""
    lm_head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    dtype = lm_head.weight.dtype
    tied = embedding is not None and embedding.weight is lm_head.weight
    for param in lm_head.parameters():
        param.data = param.data.float()
    setattr(lm_head, _FLOAT32_MARK, True)
    # The model's own forward (generate, the fidelity probe) hands it low-precision hidden
    # states: float32 inputs for the float32 weights, as TRL's patched head takes them.
    lm_head.register_forward_pre_hook(
        lambda module, args: (args[0].float(), *args[1:]) if args else args)
    if tied and dtype != torch.float32:
        embedding.register_forward_hook(
            lambda module, args, output: output.to(dtype))


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

"""The model's shape: the few numbers of a decoder-only model that the plan and its rules
need, read from a transformers config. `model_shape.py` finds the config (a plain dict, a
local config.json, the hub, or the known-models table).

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from longctx_cli.config.rope import context_line
from longctx_cli.errors import UserError
from longctx_cli.families import family

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_LINEARS + MLP_LINEARS


# ---- model shape ------------------------------------------------------------------------


def _family_passes_sinks(model_type: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # locates it without importing it
    if spec is None or spec.origin is None:
        return False
    name = model_type.replace("-", "_")
    source = Path(spec.origin).parent / "models" / name / f"modeling_{name}.py"
    try:
        return "s_aux=" in source.read_text()
    except OSError:
        return False


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only model that the plan and its rules need."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    source: str = "model config"
    # What validate prints about the context: native positions, and what RoPE scaling reaches
    # (a rendering of the config: not part of the shape's identity).
    context: str | None = field(default=None, compare=False)
    # The transformers config it was read from, for the fidelity probe (None when unknown).
    hf_config: Any = field(default=None, repr=False, compare=False)
    # The plain dict it was read from without transformers (see `_plain_shape`), if so.
    plain_fields: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # The folder whose config.json `plain_fields` came from (see `_saved_plain_shape`):
    # transformers reads that file itself when the config object is needed.
    config_folder: str | None = field(default=None, repr=False, compare=False)
    # Every distinct (heads, KV heads, head dim) of its attention layers, where the layers
    # differ (Gemma 4's wider full-attention heads, dots3's narrower sliding layers); the
    # fields above hold the largest of each, which is what memory is planned for.
    layer_heads: tuple[tuple[int, int, int], ...] = ()

    def transformers_config(self) -> Any:
        """The transformers config of this model (built from the plain dict on first need:
        validate prints the plan before paying for the import), or None when unknown."""
        if self.hf_config is None and self.plain_fields is not None:
            from transformers import AutoConfig

            fields = dict(self.plain_fields)
            # Built once: the probe and the model of a rank read the same config object.
            object.__setattr__(self, "hf_config",
                               AutoConfig.from_pretrained(self.config_folder)
                               if self.config_folder is not None else
                               AutoConfig.for_model(fields.pop("model_type"), **fields))
        return self.hf_config

    def config_value(self, key: str) -> Any:
        """A field of the model's (text) config, from the transformers config or the plain
        dict it was read from; None when absent or unknown."""
        hf = self.hf_config
        if hf is not None:
            text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            return global_value(text, key)
        return (self.plain_fields or {}).get(key)

    @cached_property
    def fused_expert_weights(self) -> int:
        """Weights of the MoE experts' fused 3-D parameters (`fused_expert_names`), which
        `quantize_moe_experts` packs into 4 bits; counted on the meta-device model (0 when
        its config is unknown or it has none). Built once per shape, on first need."""
        import torch

        hf = self.transformers_config()
        if hf is None:
            return 0
        try:
            with torch.device("meta"):
                model = causal_lm_class(hf).from_config(hf)
        except Exception:  # noqa: BLE001 - a model transformers cannot skeletonise: none known
            return 0
        experts = set(fused_expert_names(model))
        return sum(p.numel() for n, p in model.named_parameters() if n in experts)

    @property
    def sliding_window(self) -> bool:
        """Some attention layer has a sliding window (the config's, on its sliding layers)."""
        types = self.config_value("layer_types")
        return bool(self.config_value("sliding_window")) and (
            types is None or any("sliding" in str(t) for t in types))

    @property
    def attention_sinks(self) -> bool:
        """The family's attention passes sinks (`s_aux`) to the attention function, read
        from its transformers modeling source (the config has no key for it)."""
        return _family_passes_sinks(self.model_type)

    @classmethod
    def from_hf_config(cls, hf_config: Any, source: str = "model config") -> ModelShape:
        """Read the shape from a transformers `PretrainedConfig` (its text part if
        multimodal), layer by layer where its layers differ (`layer_values`)."""
        text = decoder_config(hf_config, source)
        heads = layer_values(text, "num_attention_heads")
        hidden = global_value(text, "hidden_size")
        model_type = str(getattr(text, "model_type", "") or "unknown")
        attention_free = family(model_type).attention_free
        if attention_free:  # every layer a covered scan: no heads (token_mixing.py)
            heads = [0] * int(global_value(text, "num_hidden_layers") or 1)
        elif (not heads or not all(heads)) and family(model_type).recurrence_refusal:
            raise UserError(
                f"model type `{model_type}` has no attention heads: its layers are recurrences "
                f"only, and {family(model_type).recurrence_refusal}. longctx cannot split its "
                "sequence over ranks exactly.", where="base_model",
                fix="train it without sequence parallelism (plain Hugging Face training), or "
                "pick a family docs/families.md lists as exact (Mamba, Mamba2 and Falcon-Mamba "
                "are).")
        elif not heads or not all(heads):
            raise UserError(
                f"model type `{model_type}` names no attention heads longctx can read (no "
                f"`num_attention_heads` in the {source} or its text part): its layers are "
                "recurrences, or a structure of sub-models longctx does not read (e.g. an "
                "action or diffusion expert beside a language model). longctx splits a "
                "sequence over ranks for attention and for the token mixers of the hybrid "
                "families docs/families.md lists, so it cannot train this model exactly.",
                where="base_model",
                fix="train it without sequence parallelism (plain Hugging Face training), or "
                "pick a family docs/families.md lists as exact.")
        if not hidden:
            raise UserError(
                f"cannot read `hidden_size` from the {source}.",
                fix="use a decoder-only causal LM (Llama, Qwen2, Mistral, ...).",
            )
        hidden = int(hidden)
        kv = [0 if attention_free else int(k or h) for k, h in zip(
            layer_values(text, "num_key_value_heads") or [None] * len(heads), heads,
            strict=True)]
        dims = [0 if attention_free else int(d or hidden // h) for d, h in zip(
            layer_values(text, "head_dim") or [None] * len(heads), heads, strict=True)]
        intermediate = (layer_values(text, "intermediate_size")
                        or layer_values(text, "n_inner") or [4 * hidden])
        layers = {(int(h), k, d) for h, k, d in zip(heads, kv, dims, strict=True)}
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(max(i or 4 * hidden for i in intermediate)),
            num_hidden_layers=int(global_value(text, "num_hidden_layers") or 1),
            num_attention_heads=int(max(heads)),
            num_key_value_heads=max(kv),
            head_dim=max(dims),
            vocab_size=int(global_value(text, "vocab_size") or 0),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=global_value(text, "max_position_embeddings"),
            source=source,
            context=context_line(text),
            hf_config=hf_config,
            layer_heads=tuple(sorted(layers)) if len(layers) > 1 else (),
        )

    @property
    def attention_free(self) -> bool:
        """No attention layer at all (`families.Family.attention_free`): no heads."""
        return self.num_attention_heads == 0

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer (Llama naming)."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def parameter_count(self) -> int:
        """Weights of embeddings, decoder layers, norms and lm_head (biases ignored, <0.1%)."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embeddings
        return embeddings + lm_head + self.num_hidden_layers * per_layer + self.hidden_size


def fused_expert_names(model: Any) -> list[str]:
    """The parameters `quantize_moe_experts` quantizes, as Axolotl picks them: every
    parameter of three or more dimensions whose name says `expert` (transformers 5's fused
    `gate_up_proj` / `down_proj` of a MoE block, `[experts, out, in]`), which bitsandbytes'
    Linear4bit replacement leaves in full precision."""
    return [n for n, p in model.named_parameters() if p.ndim >= 3 and "expert" in n.lower()]


def is_vision_language(hf_config: Any, images: bool = False) -> bool:
    """A model longctx trains with its images: a vision part in its config, and either no
    causal LM of its own in transformers, or `images` (the run sets `processor_type`).
    Qwen3.5 and Gemma 3 have a causal LM: without a processor longctx trains that language
    model on text, as before images were supported; so does a family whose record says its
    own class trains text (`Family.trains_text`: Mistral 3)."""
    if getattr(hf_config, "vision_config", None) is None:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return images or (type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING
                      and not family(str(getattr(hf_config, "model_type", ""))).trains_text)


def causal_lm_class(hf_config: Any) -> Any:
    """`AutoModelForCausalLM`, which builds every text model longctx trains: a causal LM that
    transformers registers only beside its vision-language models (Mistral 4's
    `Mistral4ForCausalLM`, a text model in the image-text-to-text mapping) is registered
    with it first, through transformers' own `register`; so is the multimodal class of a
    family that trains text through it (`Family.trains_text`: Mistral 3, Voxtral)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        MODEL_FOR_MULTIMODAL_LM_MAPPING,
    )

    config_class = type(hf_config)
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        if family(str(getattr(hf_config, "model_type", ""))).trains_text:
            registered = MODEL_FOR_MULTIMODAL_LM_MAPPING.get(config_class, None)
        else:
            registered = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(config_class, None)
            if registered is not None and not registered.__name__.endswith("ForCausalLM"):
                registered = None
        if registered is not None:
            AutoModelForCausalLM.register(config_class, registered, exist_ok=True)
    return AutoModelForCausalLM


def decoder_config(hf_config: Any, source: str = "model config") -> Any:
    """The config of the decoder longctx trains: the text part of a multimodal config. An
    encoder-decoder model (T5-style, MusicGen, Florence-2) is refused: longctx trains
    decoder-only causal LMs, whose one decoder sees the whole sequence causally."""
    model_type = str(getattr(hf_config, "model_type", "") or "unknown")
    several = False
    try:
        text = (hf_config.get_text_config() if hasattr(hf_config, "get_text_config")
                else hf_config)
    except ValueError:  # transformers: several text configs (an encoder and a decoder)
        text, several = hf_config, True
    if several or getattr(hf_config, "is_encoder_decoder", False) or getattr(
            text, "is_encoder_decoder", False):
        raise UserError(
            f"model type `{model_type}` ({source}) is an encoder-decoder model: longctx "
            "trains decoder-only causal LMs (one decoder over the whole sequence, split "
            "across ranks), not a separate encoder and decoder.", where="base_model",
            fix="train this model without longctx, or pick a decoder-only family "
            "docs/families.md lists.")
    return text


def global_value(config: Any, key: str) -> Any:
    """`config.key`, or None; on a heterogeneous config (transformers' `per_layer_config`)
    the value the layers without an override of it hold, which reading it directly refuses
    (`AmbiguousGlobalPerLayerAttributeError`)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if read is not None:
        return read(key, None)
    return getattr(config, key, None)


def layer_values(config: Any, key: str) -> list[Any] | None:
    """`key` of every decoder layer, read the way the model reads it: from each layer's
    config on a heterogeneous config (Gemma 4's `head_dim`, dots3's head counts), from a
    per-layer list (Gemma 3n's `intermediate_size`), else the one value for all; None when
    the config has no such key."""
    n = int(global_value(config, "num_hidden_layers") or 1)
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(config.per_layer_config[i], key, None) for i in range(n)]
    value = global_value(config, key)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == n else None
    return [value] * n


def attention_softcap(shape: ModelShape) -> float | None:
    """The model's attention logit softcap (Gemma 2 style), if its config has one."""
    cap = shape.config_value("attn_logit_softcapping")
    return float(cap) if cap else None

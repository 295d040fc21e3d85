"""The model's shape: read from a plain dict, a local config.json, the hub, or the
known-models table (with a probe of whether the hub answers).

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from longctx_cli.config import known_models
from longctx_cli.config.schema import Config
from longctx_cli.config.shape import ATTENTION_LINEARS, MLP_LINEARS, ModelShape
from longctx_cli.errors import UserError
from longctx_cli.families import FAMILIES, LINEARIZED_EXPERT_LINEARS
from longctx_cli.hub import hub_reachable

# ---- reading the model config -----------------------------------------------------------


# Shape fields that `_plain_shape` reads itself, for families whose defaults for them are
# the ones below (tests/test_quickstart.py checks it against transformers for every such dict).
# Why: `transformers.AutoConfig` imports torch (1-2 s), too slow for `validate`.
_PLAIN_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
_PLAIN_FLOATS = ("rope_theta", "initializer_range", "rms_norm_eps")
# transformers' defaults of the plain families (None: as many KV heads as heads); checked
# against transformers by tests/test_quickstart.py.
_PLAIN_DEFAULTS: dict[str, dict[str, int | None]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8},
}
_PLAIN_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "vocab_size")


def _plain_shape(fields: dict[str, Any], source: str) -> ModelShape | None:
    """The shape of a plain dict of a plain family without transformers, or None when the
    dict holds anything else (then transformers reads and validates it)."""
    model_type = fields.get("model_type")
    defaults = _PLAIN_DEFAULTS.get(model_type) if isinstance(model_type, str) else None
    if defaults is None:
        return None
    if not set(_PLAIN_REQUIRED) <= fields.keys():
        return None
    for key, value in fields.items():
        if key == "model_type":
            continue
        if key in _PLAIN_INTS:
            if type(value) is not int or value <= 0:
                return None
        elif key in _PLAIN_FLOATS:
            if type(value) not in (int, float):
                return None
        elif key != "tie_word_embeddings" or type(value) is not bool:
            return None
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    if "head_dim" not in fields and hidden % heads:
        return None  # transformers decides what this means
    return ModelShape(
        model_type=fields["model_type"],
        hidden_size=hidden,
        intermediate_size=fields["intermediate_size"],
        num_hidden_layers=fields["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=fields.get("num_key_value_heads", defaults["num_key_value_heads"])
        or heads,
        head_dim=fields.get("head_dim", hidden // heads),
        vocab_size=fields["vocab_size"],
        tie_word_embeddings=fields.get("tie_word_embeddings", False),
        max_position_embeddings=fields.get(
            "max_position_embeddings", defaults["max_position_embeddings"]
        ),
        source=source,
        context=_plain_context(fields, defaults),
        plain_fields=dict(fields),
    )



# Keys of a saved config.json (`save_pretrained`) that `_saved_plain_shape` may leave out of
# the plain shape: bookkeeping, or switches at the one value under which the plain families
# compute what their plain dict does. Any other key, or another value, goes to transformers.
_SAVED_BOOKKEEPING = ("transformers_version", "dtype", "torch_dtype", "bos_token_id",
                      "eos_token_id", "pad_token_id", "unk_token_id", "use_cache",
                      "_name_or_path", "_model_name_or_path")
_SAVED_NEUTRAL: dict[str, Any] = {
    "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "pretraining_tp": 1, "rope_scaling": None, "sliding_window": None,
    "use_sliding_window": False,
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}


def _saved_plain_shape(folder: Path, source: str) -> ModelShape | None:
    """The shape of a plain family's saved config.json in `folder`, read without transformers
    (whose import costs `validate` and the launcher seconds), or None when the file holds
    anything `_plain_shape` cannot vouch for. tests/test_model_shape_saved.py holds it equal
    to transformers' reading of the same file."""
    try:
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("model_type") not in _ARCHITECTURES:
        return None
    fields = {}
    for key, value in saved.items():
        if key in _SAVED_BOOKKEEPING:
            continue
        if key in _SAVED_NEUTRAL:
            if value != _SAVED_NEUTRAL[key] or type(value) is not type(_SAVED_NEUTRAL[key]):
                return None
        elif key == "architectures":
            if value != [_ARCHITECTURES[saved["model_type"]]]:
                return None
        elif key == "layer_types":
            if not isinstance(value, list) or set(value) != {"full_attention"}:
                return None
        elif key == "max_window_layers":
            if saved.get("use_sliding_window", False) is not False:
                return None
        elif key == "rope_parameters":
            if not (isinstance(value, dict) and value.keys() == {"rope_type", "rope_theta"}
                    and value["rope_type"] == "default"):
                return None
            fields["rope_theta"] = value["rope_theta"]
        else:
            fields[key] = value
    shape = _plain_shape(fields, source)
    if shape is None:
        return None
    return dataclasses.replace(shape, plain_fields=saved, config_folder=str(folder))


def plain_module_classes(shape: ModelShape) -> dict[str, str] | None:
    """{module name: class name} of a plain family's causal LM as transformers builds it,
    from the shape alone (what the LoRA target check reads; building the model on the meta
    device costs the launcher a transformers import), or None for any other model.
    tests/test_model_shape_saved.py holds it equal to the meta-device model's modules."""
    if shape.plain_fields is None or shape.model_type not in _ARCHITECTURES:
        return None
    prefix = _ARCHITECTURES[shape.model_type].removesuffix("ForCausalLM")
    names = {"model": f"{prefix}Model", "model.embed_tokens": "Embedding",
             "model.layers": "ModuleList"}
    for i in range(shape.num_hidden_layers):
        layer = f"model.layers.{i}"
        names[layer] = f"{prefix}DecoderLayer"
        names[f"{layer}.self_attn"] = f"{prefix}Attention"
        names.update({f"{layer}.self_attn.{n}": "Linear" for n in ATTENTION_LINEARS})
        names[f"{layer}.mlp"] = f"{prefix}MLP"
        names.update({f"{layer}.mlp.{n}": "Linear" for n in MLP_LINEARS})
        names[f"{layer}.mlp.act_fn"] = "SiLUActivation"
        names[f"{layer}.input_layernorm"] = f"{prefix}RMSNorm"
        names[f"{layer}.post_attention_layernorm"] = f"{prefix}RMSNorm"
    names.update({"model.norm": f"{prefix}RMSNorm",
                  "model.rotary_emb": f"{prefix}RotaryEmbedding", "lm_head": "Linear"})
    return names


def linearized_expert_classes(model: Any) -> dict[str, str]:
    """{module name: class name} of the linear layers `llama4_linearized_experts` gives each
    fused experts module of `model` (built on the meta device), for the LoRA target check."""
    fused = {f.fused_experts for f in FAMILIES.values() if f.fused_experts}
    return {f"{name}.{proj}.{e}": "Linear" for name, module in model.named_modules()
            if type(module).__name__ in fused for proj in LINEARIZED_EXPERT_LINEARS
            for e in range(module.gate_up_proj.shape[0])}


def _plain_context(fields: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The context line of a plain dict (no RoPE scaling: a dict with one is transformers')."""
    positions = fields.get("max_position_embeddings", defaults["max_position_embeddings"])
    theta = fields.get("rope_theta")
    return (f"{positions:,} positions (native, no RoPE scaling"
            + (f", rope theta {theta:g}" if theta is not None else "") + ")")


def build_from_dict(fields: dict[str, Any], key: str) -> Any:
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        if "Unrecognized model identifier" in str(e):
            raise UserError(
                f"`{key}.model_type` = {model_type!r} is not a model type transformers knows.",
                fix="use e.g. `llama`, `qwen2` or `mistral`.",
            ) from None
        raise UserError(f"`{key}` is invalid: {e}", fix=f"correct `{key}`.") from None
    except Exception as e:  # transformers' strict config fields raise their own error types
        first = str(e).strip().splitlines()
        raise UserError(
            f"`{key}` is invalid: {' '.join(line.strip() for line in first)}",
            fix=f"correct the field in `{key}`.",
        ) from None


def _hub_cache_folder(model_id: str, revision: str | None = None) -> Path | None:
    """The local Hugging Face cache's folder of this id's config.json (at `revision`, else
    main), if it holds one."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json", revision=revision)
    except Exception:  # an id the hub client rejects: let transformers say why
        return None
    return Path(found).parent if isinstance(found, str) else None


def _from_table(model_id: str, reason: str) -> ModelShape | None:
    fields = known_models.lookup(model_id)
    if fields is None:
        return None
    source = f"{model_id} (built-in table; {reason})"
    shape = _plain_shape(fields, source)
    if shape is not None:
        return shape
    hf = build_from_dict(fields, "base_model")
    return ModelShape.from_hf_config(hf, source=source)


def apply_model_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> Any:
    """`overrides_of_model_config` applied to a transformers config (and its text part)."""
    if overrides:
        hf_config.update(dict(overrides))
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
        if text is not None and text is not hf_config:
            text.update(dict(overrides))
    return hf_config


def read_model_config(config: Config) -> ModelShape:
    """The model's shape, `overrides_of_model_config`, `rope_scaling` and `rope_theta` applied
    (see `_read_model_config`): the one builder of the model's config, for the plan, the
    probe and the model every rank builds."""
    shape = _read_model_config(config)
    overrides = config.model.overrides_of_model_config
    if config.model.model_config_dict is not None:
        overrides = None  # merged into the dict there
    rope_asked = config.model.rope_scaling is not None or config.model.rope_theta is not None
    if not overrides and not rope_asked:
        return shape
    hf = shape.transformers_config()
    if hf is None:  # a built-in table shape: no config to override
        return shape
    hf = apply_model_overrides(copy.deepcopy(hf), overrides)
    source = shape.source + (", overrides_of_model_config" if overrides else "")
    if rope_asked:
        from longctx_cli.config.rope import rope_overrides

        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        hf = apply_model_overrides(hf, rope_overrides(text, config.model.rope_scaling,
                                                      config.model.rope_theta,
                                                      config.data.sequence_len))
        source += ", rope_scaling" if config.model.rope_scaling is not None else ", rope_theta"
    return ModelShape.from_hf_config(hf, source=source)


def _read_model_config(config: Config) -> ModelShape:
    """The model's shape: from `model_config`, a local path, the local cache, the hub, or,
    for a few well-known ids when the hub cannot be used, from `known_models`."""
    if config.model.model_config_dict is not None:
        fields = {**config.model.model_config_dict,
                  **(config.model.overrides_of_model_config or {})}
        shape = _plain_shape(fields, "inline `model_config`")
        if shape is not None:
            return shape
        hf = build_from_dict(fields, "model_config")
        return ModelShape.from_hf_config(hf, source="inline `model_config`")
    model_id = str(config.model.base_model_config or config.model.base_model)
    trust = config.model.trust_remote_code
    local = Path(model_id).expanduser()
    if not local.exists() and _is_path_not_id(model_id):
        raise UserError(
            f"`base_model` = {model_id!r} is a path (a hub id is `owner/name`), and there is "
            f"no such folder here ({Path.cwd()}).",
            fix="run the command from the folder the path is relative to, or first create "
            "the model it names (e.g. a run's `output_dir/final`; examples/tiny_grpo.yaml "
            "starts from the Quickstart's outputs/tiny_passkey/final).")
    revision = config.model.revision_kwargs(model_id)
    at = f"@{revision['revision']}" if revision else ""  # the revision, in the plan's source
    cached = None if local.exists() else _hub_cache_folder(model_id, **revision)
    if not local.exists() and cached is None and not hub_reachable():
        # Offline and not cached: the built-in table answers without importing transformers.
        shape = _from_table(model_id, "the hub is unreachable")
        if shape is not None:
            return shape
    saved_folder = local if local.is_dir() else cached
    if saved_folder is not None and not trust:
        where = (f"local path {model_id}" if local.exists()
                 else f"{model_id}{at} (local cache)")
        shape = _saved_plain_shape(saved_folder, where)
        if shape is not None:
            return shape
    from transformers import AutoConfig

    if local.exists():
        try:
            hf = AutoConfig.from_pretrained(str(local), trust_remote_code=trust)
        except (OSError, ValueError) as e:
            raise UserError(
                f"`base_model` = {model_id!r} is a local path but its config cannot be read: "
                f"{str(e).splitlines()[0]}",
                fix="point `base_model` at a folder with a config.json.",
            ) from None
        return ModelShape.from_hf_config(hf, source=f"local path {model_id}")
    try:
        hf = AutoConfig.from_pretrained(model_id, trust_remote_code=trust, local_files_only=True,
                                        **revision)
        return ModelShape.from_hf_config(hf, source=f"{model_id}{at} (local cache)")
    except (OSError, ValueError):
        pass  # not cached: ask the hub below
    if not hub_reachable():
        shape = _from_table(model_id, "the hub is unreachable")
        if shape is not None:
            return shape
        raise _unreadable(model_id, "the Hugging Face hub is unreachable and it is not cached")
    try:
        hf = AutoConfig.from_pretrained(model_id, trust_remote_code=trust, **revision)
    except (OSError, ValueError) as e:
        shape = _from_table(model_id, "the hub refused the download")
        if shape is not None:
            return shape
        raise _unreadable(model_id, str(e).splitlines()[0]) from None
    return ModelShape.from_hf_config(hf, source=f"{model_id}{at} (hub)")


def _is_path_not_id(model_id: str) -> bool:
    """A name no hub id can be: absolute, relative (`./`, `../`, `~`) or with more than one
    `/`."""
    return model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1


def _unreadable(model_id: str, why: str) -> UserError:
    known = ", ".join(sorted({k for k in known_models.KNOWN_MODELS if "instruct" not in k}))
    return UserError(
        f"cannot read the config of `base_model` = {model_id!r}: {why}.",
        fix="check the id, connect to the hub (or log in for gated models), point `base_model` "
        "at a local folder, or describe the model inline with `model_config`. Ids with a "
        f"built-in shape that work offline: {known}.",
    )

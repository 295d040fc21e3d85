"""Context extension: `rope_scaling` and `rope_theta` (Axolotl's keys) on the model's RoPE.

transformers 5 keeps a model's rotary settings in `config.rope_parameters` (`rope_type`,
`rope_theta`, `factor`, `original_max_position_embeddings`, yarn's `beta_fast`/`beta_slow`,
llama3's `low_freq_factor`/`high_freq_factor`, ...). Axolotl and older configs write
`rope_scaling: {type: yarn, factor: 4}`; here both become the model config's own fields, so
the plan, the fidelity probe, training and every saved `config.json` use them, and a plain
`AutoModelForCausalLM.from_pretrained` of the result computes the extended model.

Every SP strategy computes the rotary exactly as the model does when the rotary is a function
of the token's position alone: the ranks pass global positions, and the model's own rotary
module turns them into cos/sin. `linear`, `yarn` and `llama3` are such scalings. `dynamic`
(NTK) and `longrope` are not: they change their frequencies with the longest position of the
forward they see, which under SP is a rank's slice and in a packed row the longest document,
not the document the model's own forward would see; they are refused with that reason.
"""

from __future__ import annotations

import math
from typing import Any

from longctx_cli.errors import UserError

# Scalings whose rotary depends on the position alone: exact under every strategy.
STATIC_SCALINGS = ("linear", "yarn", "llama3")
# Scalings that re-derive their frequencies from the length of the forward.
LENGTH_DEPENDENT = ("dynamic", "longrope")
# Fields each scaling takes besides `factor` (and the shared `original_max_position_embeddings`).
SCALING_FIELDS = {
    "linear": (),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
             "truncate"),
    "llama3": ("low_freq_factor", "high_freq_factor"),
    "dynamic": (),
    "longrope": ("short_factor", "long_factor", "attention_factor"),
}
# What each scaling needs from the model's native context (transformers computes its
# correction from it).
NEEDS_ORIGINAL = ("yarn", "llama3", "longrope")


def scaling_type(scaling: dict[str, Any]) -> str | None:
    """`rope_type` of an Axolotl-style `rope_scaling` (`type` is the older name)."""
    value = scaling.get("rope_type", scaling.get("type"))
    return str(value) if value is not None else None


def check_rope_settings(scaling: dict[str, Any] | None) -> None:
    """The shape of `rope_scaling` alone (no model needed); raises UserError."""
    if scaling is None:
        return
    kind = scaling_type(scaling)
    known = ", ".join((*STATIC_SCALINGS, *LENGTH_DEPENDENT))
    if kind is None:
        raise UserError("`rope_scaling` names no scaling type.", where="rope_scaling",
                        fix=f"add `type:` (or `rope_type:`) with one of {known}, e.g. "
                        "`rope_scaling: {type: yarn, factor: auto}`.")
    if kind not in SCALING_FIELDS:
        raise UserError(f"`rope_scaling` type {kind!r} is not a RoPE scaling transformers "
                        "computes.", where="rope_scaling", fix=f"use one of {known}.")
    if kind in LENGTH_DEPENDENT:
        raise UserError(
            f"`rope_scaling` type {kind!r} re-derives the rotary frequencies from the longest "
            "position of each forward pass; under sequence parallelism that is a rank's slice "
            "of the row, and in a packed row the longest document of the row, not the document "
            "the model's own forward sees, so the model would train on different positions "
            "than it runs with.",
            where="rope_scaling",
            fix="use `type: yarn` (what dynamic NTK approximates, with a fixed factor), "
            "`linear` or `llama3`, each exact under every strategy.",
        )
    factor = scaling.get("factor")
    if factor != "auto" and not (isinstance(factor, (int, float)) and not isinstance(
            factor, bool) and factor >= 1):
        raise UserError(f"`rope_scaling.factor` = {factor!r} is not a number >= 1 or `auto`.",
                        where="rope_scaling.factor",
                        fix="set the factor by which the context grows (e.g. 4), or `auto` "
                        "for sequence_len / the model's native context.")
    allowed = {"type", "rope_type", "factor", "original_max_position_embeddings",
               *SCALING_FIELDS[kind]}
    unknown = sorted(set(scaling) - allowed)
    if unknown:
        raise UserError(f"`rope_scaling` has field(s) {', '.join(unknown)} that a {kind} "
                        "scaling does not take.", where="rope_scaling",
                        fix=f"a {kind} scaling takes: {', '.join(sorted(allowed))}.")


def native_context(hf_config: Any) -> int | None:
    """The positions the model was pretrained on: the scaling's `original_max_position_
    embeddings` where the config has one, else `max_position_embeddings` (divided by a
    linear scaling's factor, which records no original length)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict):
        original = params.get("original_max_position_embeddings")
        if isinstance(original, int):
            return original
    value = getattr(hf_config, "original_max_position_embeddings", None)
    if isinstance(value, int):
        return value
    value = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(value, int):
        return None
    if isinstance(params, dict) and params.get("rope_type") == "linear":
        factor = params.get("factor")
        if isinstance(factor, (int, float)) and factor >= 1:
            return round(value / factor)
    return value


def _nested(params: Any) -> bool:
    """One dict of rotary settings per layer type (Gemma 3: sliding vs full attention)."""
    return isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())


def rope_overrides(
    hf_config: Any, scaling: dict[str, Any] | None, theta: float | None, sequence_len: int
) -> dict[str, Any]:
    """The model-config fields that give `hf_config` the scaling and theta asked for:
    `rope_parameters` (the model's own, updated) and `max_position_embeddings` (the context
    the scaling reaches, so the saved model says how far it goes). Empty when nothing is asked."""
    if scaling is None and theta is None:
        return {}
    check_rope_settings(scaling)
    params = getattr(hf_config, "rope_parameters", None)
    if _nested(params):
        kinds = ", ".join(sorted(k for k, v in params.items() if isinstance(v, dict)))
        raise UserError(
            f"this model has one RoPE per layer type ({kinds}), so a single `rope_scaling` / "
            "`rope_theta` does not say which layers to change.",
            where="rope_scaling" if scaling is not None else "rope_theta",
            fix="set them per layer type with `overrides_of_model_config: {rope_parameters: "
            "{...}}` (the model config's own field).",
        )
    native = native_context(hf_config)
    new = dict(params or {})
    new.setdefault("rope_type", "default")
    if theta is not None:
        new["rope_theta"] = float(theta)
    out: dict[str, Any] = {}
    if scaling is not None:
        kind = scaling_type(scaling)
        fields = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
        original = fields.get("original_max_position_embeddings", native)
        if not isinstance(original, int) or original < 1:
            raise UserError("the model's config does not say its native context "
                            "(max_position_embeddings).", where="rope_scaling",
                            fix="add `original_max_position_embeddings: N` to `rope_scaling`.")
        if fields.get("factor") == "auto":
            # As LLaMA-Factory does: the smallest whole factor that covers sequence_len.
            fields["factor"] = float(max(1, math.ceil(sequence_len / original)))
        fields["factor"] = float(fields["factor"])
        for key in ("rope_type", "factor", *SCALING_FIELDS.get(str(kind), ()),
                    "original_max_position_embeddings"):
            new.pop(key, None)
        new.update(rope_type=kind, **fields)
        if kind in NEEDS_ORIGINAL:
            new["original_max_position_embeddings"] = original
        out["max_position_embeddings"] = int(original * fields["factor"])
    out["rope_parameters"] = new
    return out


def context_line(hf_config: Any) -> str | None:
    """What `validate` prints about the model's context: native, and what a scaling reaches."""
    native = native_context(hf_config)
    if native is None:
        return None
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict) or _nested(params):
        return f"{native:,} positions"
    kind = params.get("rope_type", "default")
    theta = params.get("rope_theta")
    theta_text = f", rope theta {theta:g}" if isinstance(theta, (int, float)) else ""
    if kind in (None, "default"):
        return f"{native:,} positions (native, no RoPE scaling{theta_text})"
    reached = getattr(hf_config, "max_position_embeddings", None)
    factor = params.get("factor")
    factor_text = f" x{factor:g}" if isinstance(factor, (int, float)) else ""
    return (f"{native:,} native positions; {kind}{factor_text} RoPE scaling reaches "
            f"{reached:,}{theta_text}")


def check_context(sequence_len: int, scaling: dict[str, Any] | None, hf_config: Any,
                  reached: int | None) -> None:
    """The model's own rotary is exact under SP, and `sequence_len` fits what a requested
    scaling reaches (`reached`: the model's `max_position_embeddings` after it)."""
    params = getattr(hf_config, "rope_parameters", None) if hf_config is not None else None
    kind = params.get("rope_type") if isinstance(params, dict) and not _nested(params) else None
    if scaling is None and kind in LENGTH_DEPENDENT:
        raise UserError(
            f"the model's own RoPE scaling is {kind!r}, which re-derives the rotary frequencies "
            "from the longest position of each forward pass; under sequence parallelism and "
            "packing that is not the document the model's own forward sees, so longctx would "
            "train a different model than the one you load.",
            where="rope_scaling",
            fix="set a position-only scaling, e.g. `rope_scaling: {type: yarn, factor: auto}` "
            "(yarn is what dynamic NTK approximates with a fixed factor).",
        )
    if scaling is not None and reached is not None and sequence_len > reached:
        raise UserError(
            f"`sequence_len` = {sequence_len:,} is beyond the {reached:,} positions the RoPE "
            f"scaling reaches ({context_line(hf_config)}).",
            where="rope_scaling.factor",
            fix=f"raise the factor (`factor: auto` covers sequence_len), or lower sequence_len "
            f"to {reached:,}.",
        )

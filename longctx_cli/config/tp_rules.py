"""`validate` rules and plan helpers for `tensor_parallel_size` (TP-sp, see
`parallel/tensor_parallel.py`). Pure Python: no torch.distributed here.

The world is the mesh dp x cp x tp with tp fastest: a TP group is `tp` consecutive ranks
(the closest ones: TP moves activations four times per layer), an SP group is `sp` ranks
`tp` apart, and DP groups take what is left.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from longctx_cli.errors import UserError
from longctx_cli.layout import divisors

if TYPE_CHECKING:
    from longctx_cli.config.model_shape import ModelShape
    from longctx_cli.config.schema import Config

# Families whose transformers `base_model_tp_plan` is colwise/rowwise only and whose decoder
# layers hold nothing but attention, MLP and norms (what the TP-sp plan shards exactly).
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _refuse(what: str, fix: str) -> UserError:
    return UserError(f"`tensor_parallel_size` > 1 with {what}", fix=fix)


def check_tp_config(config: Config) -> None:
    """Combinations TP-sp does not (yet) train exactly: refused, never silently wrong."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    if config.adapter == "lora" and config.lora_dropout:
        raise _refuse(
            f"`lora_dropout` = {config.lora_dropout} is not supported: the dropout masks of "
            "activations replicated over the TP group would have to agree across its ranks.",
            "set `lora_dropout: 0`.")
    if config.tiled_mlp:
        raise _refuse("`tiled_mlp` is not supported (TP already splits the MLP's columns).",
                      "set `tiled_mlp: false`.")
    if config.activation_offloading:
        raise _refuse("`activation_offloading` is not supported (untested with DTensor "
                      "activations).", "set `activation_offloading: false`.")


def check_tp_model(config: Config, shape: ModelShape) -> None:
    """Heads / KV heads / intermediate size divisible by T; a family TP-sp can shard."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    if shape.model_type not in TP_FAMILIES:
        raise _refuse(
            f"model type `{shape.model_type}` is not supported; TP-sp shards the dense "
            f"decoders {', '.join(TP_FAMILIES)} from their transformers `base_model_tp_plan`.",
            "use `tensor_parallel_size: 1` (sequence parallelism + FSDP) for this model.")
    for name, value in (("num_attention_heads", shape.num_attention_heads),
                        ("num_key_value_heads", shape.num_key_value_heads),
                        ("intermediate_size", shape.intermediate_size),
                        ("vocab_size", shape.vocab_size)):
        if value % tp:
            raise UserError(
                f"`tensor_parallel_size` = {tp}: the model's {name} = {value} is not divisible "
                f"by {tp}; every TP rank must get an equal share.",
                fix=f"use a tensor_parallel_size dividing {value} ({divisors(value)}).",
            )


def tp_local_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one TP rank holds: 1/tp of the heads, KV heads, MLP columns and vocabulary.

    Its `parameter_count()` is the per-rank count (norms stay whole), and the SP rules
    (Ulysses head split, ring `heads_k_stride`) apply to these local heads.
    """
    if tp == 1:
        return shape
    return replace(
        shape,
        num_attention_heads=shape.num_attention_heads // tp,
        num_key_value_heads=shape.num_key_value_heads // tp,
        intermediate_size=shape.intermediate_size // tp,
        vocab_size=shape.vocab_size // tp,
        hf_config=None,
    )


def layout_rows(dp: int, sp: int, tp: int, sp_shard_tokens: int) -> list[tuple[str, str]]:
    """Plan rows describing the 3-D layout (`sp_shard_tokens`: tokens of one SP shard)."""
    if tp == 1:
        return []
    example = [[(0 * sp + c) * tp + t for t in range(tp)] for c in range(sp)]
    return [
        ("tensor parallel", f"{tp} (TP-sp: sequence-sharded activations, vocab-parallel loss); "
                            f"attention and MLP see the SP shard's {sp_shard_tokens:,} tokens "
                            f"with 1/{tp} of the heads and columns, norms and the residual "
                            f"stream {sp_shard_tokens // tp:,} tokens"),
        ("mesh", f"dp {dp} x cp {sp} x tp {tp}; TP groups = {tp} consecutive ranks, e.g. "
                 f"{example[0]}; SP groups = ranks {tp} apart"
                 + (f", e.g. {[row[0] for row in example]}" if sp > 1 else "")),
    ]


def tp_notes(config: Config, nproc_per_node: int | None) -> list[str]:
    """Legal but worth knowing."""
    tp = config.tensor_parallel_size
    if tp > 1 and nproc_per_node and tp > nproc_per_node:
        return [f"TP groups of {tp} span nodes ({nproc_per_node} ranks per node): TP-sp moves "
                "activations 8 times per layer over the network; keep tensor_parallel_size "
                "<= ranks per node and use sequence parallelism across nodes."]
    return []

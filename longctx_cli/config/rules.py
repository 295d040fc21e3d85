"""The rules a config must satisfy against the world size and the model; each raises a
`UserError` naming the key, its value, why and how to fix it.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longctx_cli.config.model_shape import ModelShape
from longctx_cli.config.schema import Config
from longctx_cli.config.world import Platform
from longctx_cli.errors import UserError
from longctx_cli.kernel_choice import HALF_DTYPES, KernelChoice, KernelError, choose_kernel

if TYPE_CHECKING:
    pass

# ---- the rules --------------------------------------------------------------------------


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else ds[0]


def _check_world(sp: int, world: int, world_source: str) -> None:
    if sp > world:
        raise UserError(
            f"`sequence_parallel_degree` = {sp} is larger than the world size {world} "
            f"({world_source}): a sequence cannot be split over more ranks than exist.",
            fix=f"set `sequence_parallel_degree` to {_divisors(world)}, or launch at least "
            f"{sp} ranks (--nproc-per-node / --nnodes).",
        )
    if world % sp:
        raise UserError(
            f"`sequence_parallel_degree` = {sp} does not divide the world size {world} "
            f"({world_source}): every rank must belong to one SP group of {sp} ranks.",
            fix=f"set `sequence_parallel_degree` to {_divisors(world)}, or run a multiple of "
            f"{sp} ranks.",
        )


def ulysses_size(config: Config, sp: int) -> int:
    """Ranks per Ulysses (all-to-all) group: sp for ulysses, `ulysses_degree` for hybrid."""
    mode, u = config.sequence_parallel_mode, config.ulysses_degree
    if mode != "hybrid" and u is not None:
        raise UserError(
            f"`ulysses_degree` = {u} is only used by `sequence_parallel_mode: hybrid`, "
            f"but the mode is {mode!r}.",
            fix="remove `ulysses_degree`, or set `sequence_parallel_mode: hybrid`.",
        )
    if mode == "ring":
        return 1
    if mode == "ulysses":
        return sp
    if u is None:
        raise UserError(
            "`sequence_parallel_mode: hybrid` needs `ulysses_degree` (ranks per all-to-all "
            "group; the ring runs across the groups).",
            fix=f"add `ulysses_degree: N` with N dividing `sequence_parallel_degree` = {sp} "
            f"({_divisors(sp)}), usually the GPUs per node.",
        )
    if sp % u:
        raise UserError(
            f"`ulysses_degree` = {u} does not divide `sequence_parallel_degree` = {sp}: the "
            "SP group must split into equal Ulysses groups.",
            fix=f"set `ulysses_degree` to {_divisors(sp)}.",
        )
    return u


def check_heads(config: Config, shape: ModelShape, sp: int, ulysses: int) -> None:
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    key = "ulysses_degree" if config.sequence_parallel_mode == "hybrid" else (
        "sequence_parallel_degree"
    )
    if ulysses > 1 and heads % ulysses:
        raise UserError(
            f"`{key}` = {ulysses}: the model's num_attention_heads = {heads} is not divisible "
            f"by the Ulysses group size {ulysses}; all-to-all gives each rank heads/{ulysses} "
            "whole heads.",
            fix=f"use a Ulysses size dividing {heads} ({_divisors(heads)}), or "
            "`sequence_parallel_mode: ring`.",
        )
    if ulysses > 1 and kv % ulysses and ulysses % kv:
        raise UserError(
            f"`{key}` = {ulysses}: the model's num_key_value_heads = {kv} can neither be split "
            f"evenly over {ulysses} ranks nor replicated to them ({ulysses} is not a multiple "
            f"of {kv}).",
            fix=f"use a Ulysses size that divides {kv} or is a multiple of it, or "
            "`sequence_parallel_mode: ring`.",
        )
    if sp // ulysses > 1:
        ring_kv = max(1, kv // ulysses)  # KV heads each rank holds once Ulysses has run
        if ring_kv % config.heads_k_stride:
            where = f"num_key_value_heads = {kv}" + (
                f" ({ring_kv} per rank after the all-to-all)" if ulysses > 1 else ""
            )
            raise UserError(
                f"`heads_k_stride` = {config.heads_k_stride} does not divide the model's "
                f"{where}: the ring gathers K,V in chunks of that many heads.",
                fix=f"set `heads_k_stride` to {_divisors(ring_kv)}.",
            )


def check_sequence_len(config: Config, sp: int) -> None:
    zigzag = config.sp_sharding == "zigzag" and sp > 1
    multiple = 2 * sp if zigzag else sp
    if config.sequence_len % multiple:
        why = (
            f"zigzag sharding cuts a row into 2 x {sp} equal chunks"
            if zigzag
            else f"each of the {sp} ranks gets an equal slice of a row"
        )
        lower = config.sequence_len // multiple * multiple
        raise UserError(
            f"`sequence_len` = {config.sequence_len} is not a multiple of {multiple}: {why}.",
            fix=f"set `sequence_len` to a multiple of {multiple}, e.g. {max(lower, multiple)} "
            f"or {lower + multiple}.",
        )


def _resolve_kernel(config: Config, sp: int, platform: Platform) -> tuple[str, str]:
    """The attention kernel that will run, and why (`kernel_choice.choose_kernel` decides)."""
    kernel = config.attention_kernel
    if kernel in ("flash", "torch_flash") and not platform.cuda:
        raise UserError(
            f"`attention_kernel` = {kernel!r} needs a CUDA GPU, and torch sees none here.",
            fix="use `attention_kernel: auto` (picks torch here) or `torch`, or run on a "
            "machine with CUDA.",
        )
    if kernel == "flash" and not platform.ring_flash_attn:
        raise UserError(
            "`attention_kernel` = 'flash' needs the `ring_flash_attn` and `flash_attn` "
            "packages, and they cannot be imported here.",
            fix="`pip install 'longctx[gpu]'`, or use `attention_kernel: torch_flash` "
            "(PyTorch's own flash-attention op, no extra package).",
        )
    if kernel in ("flash", "torch_flash") and config.dtype not in HALF_DTYPES:
        raise UserError(
            f"`attention_kernel` = {kernel!r} computes in bf16/fp16 only, and `dtype` is "
            f"{config.dtype!r}.",
            fix="set `dtype: bfloat16`, or `attention_kernel: auto` / `torch` for float32.",
        )
    choice = _choose(config, platform)
    return choice.kernel, choice.reason


def _choose(config: Config, platform: Platform) -> KernelChoice:
    try:
        return choose_kernel(
            config.attention_kernel, config.sp_sharding, cuda=platform.cuda,
            flash_attn=platform.ring_flash_attn, dtype=config.dtype,
            ring_attn_func=config.ring_attn_func,
        )
    except KernelError as err:
        raise UserError(err.message, fix=err.fix) from None


def _check_ring_func(config: Config, sp: int) -> None:
    """The stripe layout exists only for batch_stripe, which has no Ulysses form."""
    mode, func = config.sequence_parallel_mode, config.ring_attn_func
    if config.sp_sharding == "stripe" and mode != "ring" and sp > 1:
        raise UserError(
            f"`sp_sharding: stripe` (`ring_attn_func: {func}`) is not supported by "
            f"`sequence_parallel_mode: {mode}`: "
            + ("the all-to-all would reorder one-token pieces" if mode == "ulysses" else
               "a Ulysses group's tokens are not one stripe of the ring across the groups")
            + ".",
            fix="use `ring_attn_func: batch_zigzag` (or batch_ring) with hybrid, "
            "`sp_sharding: zigzag` with ulysses, or `sequence_parallel_mode: ring`.",
        )


def _check_zigzag_kernel(config: Config) -> None:
    # Only the layout rule: it needs no machine (`choose_kernel` raises before looking).
    _choose(config, Platform(cuda=False, ring_flash_attn=False))


def _check_data_parallel(config: Config, world: int, sp: int) -> None:
    """Axolotl's rule: dp_replicate_size x dp_shard_size x sp = world (given ones only)."""
    dp = world // sp
    rep_, shard = config.dp_replicate_size, config.dp_shard_size
    if rep_ is None and shard is None:
        return
    product = (rep_ or 1) * (shard or 1)
    if (rep_ is not None and shard is not None and product != dp) or dp % product:
        given = " x ".join(f"{k} {v}" for k, v in (("dp_replicate_size", rep_),
                                                     ("dp_shard_size", shard)) if v is not None)
        raise UserError(
            f"{given} does not fit the {dp} data-parallel ranks (world {world} / "
            f"sequence_parallel_degree {sp}).",
            fix="make dp_replicate_size x dp_shard_size equal world / sequence_parallel_degree, "
            "or leave one of them out.",
        )
    if rep_ is not None and rep_ > 1 and not config.fsdp:
        raise UserError(
            f"`dp_replicate_size` = {rep_} replicates sharded weights, but FSDP is off.",
            fix="set `dp_shard_size` > 1 or `fsdp: true` (HSDP), or drop dp_replicate_size.",
        )


def hsdp_replicas(config: Config) -> int:
    """Replica groups of an HSDP mesh (1: plain FSDP over the whole world)."""
    return config.dp_replicate_size or 1 if config.fsdp else 1


def _check_adapter(config: Config) -> None:
    if config.adapter is None:
        return
    if config.fsdp and (config.load_in_4bit or config.load_in_8bit):
        raise UserError(
            "FSDP with a bitsandbytes-quantized base (qlora / load_in_4bit / load_in_8bit) is "
            "not supported yet.",
            fix="turn FSDP off (fsdp, fsdp_config, deepspeed, dp_shard_size) for QLoRA: the "
            "4-bit base is small, and sequence parallelism still splits the sequence.",
        )
    targets = config.lora_target_modules
    if not targets or (isinstance(targets, str) and not targets.strip()):
        raise UserError(
            f"`lora_target_modules` = {targets!r} is empty: LoRA would train nothing.",
            fix="list module names, e.g. `[q_proj, k_proj, v_proj, o_proj]`, or `all-linear`.",
        )


def _advice(
    config: Config, shape: ModelShape, sp: int, ulysses: int, nproc_per_node: int | None
) -> list[str]:
    """Legal but worth knowing."""
    notes = []
    if shape.max_position_embeddings and config.sequence_len > shape.max_position_embeddings:
        notes.append(
            f"sequence_len {config.sequence_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}; consider RoPE scaling or a larger rope_theta."
        )
    if nproc_per_node and ulysses > nproc_per_node:
        notes.append(
            f"Ulysses groups of {ulysses} span nodes ({nproc_per_node} ranks per node): the "
            "all-to-all crosses the network; hybrid with ulysses_degree <= ranks per node is "
            "usually faster."
        )
    if config.sequence_parallel_mode == "hybrid" and ulysses in (1, sp):
        same = "ring" if ulysses == 1 else "ulysses"
        notes.append(f"hybrid with ulysses_degree {ulysses} is the same as `{same}`.")
    if config.activation_offloading and not config.gradient_checkpointing:
        notes.append(
            "activation_offloading without gradient_checkpointing copies every saved tensor "
            "to host memory and back; with checkpointing only each layer's input moves."
        )
    p2p = config.ring_attn_func != "varlen_llama3"
    if p2p and sp // ulysses == 1 and sp > 1:
        notes.append(f"ring_attn_func {config.ring_attn_func} is unused: there is no ring "
                     f"({config.sequence_parallel_mode} over all {sp} ranks).")
    if p2p and config.heads_k_stride != 1 and sp // ulysses > 1:
        notes.append("heads_k_stride is unused by a P2P ring: each block carries all its KV "
                     "heads.")
    if ulysses > shape.num_key_value_heads:
        notes.append(
            f"KV heads ({shape.num_key_value_heads}) are replicated to {ulysses} Ulysses ranks."
        )
    return notes

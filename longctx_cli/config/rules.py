"""The rules a config must satisfy against the world size and the model; each raises a
`UserError` naming the key, its value, why and how to fix it.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longctx_cli.config import tp_rules
from longctx_cli.config.memory_estimate import attention_softcap
from longctx_cli.config.model_shape import ModelShape
from longctx_cli.config.schema import Config
from longctx_cli.config.world import Platform
from longctx_cli.constants import HYBRID_MODEL_TYPES
from longctx_cli.errors import UserError
from longctx_cli.kernel_choice import KernelError, ModelAttention, choose_kernel
from longctx_cli.layout import (
    Layout,
    LayoutError,
    check_world,
    data_parallel_degrees,
    default_ring,
    ulysses_degree_for,
)

if TYPE_CHECKING:
    pass

# ---- the rules --------------------------------------------------------------------------


def layout_for(
    config: Config, world: int, platform: Platform | None, world_source: str = "given",
    shape: ModelShape | None = None,
) -> Layout:
    """The run's :class:`Layout`: the degrees, sharding, ring and kernel of `config` on
    `world` ranks of `platform`. `validate` and every rank build it here, so they agree.

    `platform` None: no machine is asked (an explicit kernel is kept, `auto` is planned as
    without CUDA); for the rules that need no machine. `shape`: the model, whose attention
    (head dim, softcap, sinks, window) the kernel must compute."""
    sp, tp = config.sequence_parallel_degree, config.tensor_parallel_size
    try:
        check_world(sp, tp, world, world_source)
        ulysses = ulysses_degree_for(config.sequence_parallel_mode, sp, config.ulysses_degree)
        if config.ring_attn_func is not None:  # named (or implied by sp_sharding): the
            ring_attn_func, sharding = config.ring_attn_func, config.sp_sharding  # schema's
        else:
            ring_attn_func, sharding = default_ring(
                config.sequence_parallel_mode, tp, None, None,
                "heads_k_stride" in config.model_fields_set, config.attention_kernel)
        kernel, reason = _resolve_kernel(config, platform, sp // ulysses, shape,
                                         ring_attn_func, sharding)
        replicas, shards = data_parallel_degrees(world, sp, tp, config.fsdp,
                                                 config.dp_replicate_size, config.dp_shard_size)
        # Fills `world` by construction: the ranks check it again on the real world (mesh).
        return Layout(
            sp=sp, tp=tp, dp_replicate=replicas, dp_shard=shards, fsdp=config.fsdp,
            mode=config.sequence_parallel_mode, ulysses=ulysses, sharding=sharding,
            ring_attn_func=ring_attn_func, heads_k_stride=config.heads_k_stride,
            kernel=kernel, kernel_reason=reason,
        )
    except LayoutError as err:
        raise UserError(err.message, fix=err.fix) from None


def check_heads(layout: Layout, shape: ModelShape) -> None:
    """The heads one TP rank holds fit the layout's Ulysses split and heads_k_stride."""
    local = tp_rules.tp_local_shape(shape, layout.tp)
    try:
        layout.check_heads(local.num_attention_heads, local.num_key_value_heads)
    except LayoutError as err:
        raise UserError(err.message, fix=err.fix) from None


# The names transformers' families give the dropout on attention probabilities.
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                          "attn_dropout")


def check_attention_dropout(shape: ModelShape) -> None:
    """SP attention computes no dropout on the attention probabilities: a model whose config
    asks for it is refused, never trained as another model."""
    for key in ATTENTION_DROPOUT_KEYS:
        p = shape.config_value(key)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            raise UserError(
                f"the model's {key} = {p:g}: longctx's sequence-parallel attention applies no "
                "dropout to the attention probabilities, so it would train a different model "
                "than the one you load.",
                where="overrides_of_model_config",
                fix=f"add `overrides_of_model_config: {{{key}: 0.0}}` to train without "
                "attention dropout (as long-context fine-tunes usually do).",
            )


def check_router_aux_loss(shape: ModelShape) -> None:
    """A mixture-of-experts config with `output_router_logits: true` makes the model's own
    training add `router_aux_loss_coef` x the load-balancing loss to the language-model loss;
    longctx trains the language-model loss alone, so such a config is refused."""
    coef = shape.config_value("router_aux_loss_coef")
    if shape.config_value("output_router_logits") is True and (
            not isinstance(coef, (int, float)) or coef > 0):
        raise UserError(
            "the model's config has output_router_logits: true, with which its own training "
            f"adds router_aux_loss_coef ({coef}) x the router load-balancing loss to the loss; "
            "longctx trains the language-model loss alone, so it would train differently "
            "from the model's own training.",
            where="overrides_of_model_config",
            fix="add `overrides_of_model_config: {output_router_logits: false}` to train with "
            "the language-model loss alone (the routers still learn through it).",
        )


def check_grpo_router_aux_loss(config: Config, shape: ModelShape) -> None:
    """`rl: grpo` on a mixture-of-experts model: at TRL's default (`router_aux_loss_coef`
    null) TRL adds the model's coefficient x the load-balancing loss to the GRPO loss for any
    model whose config has `output_router_logits`; longctx does not, so it asks for 0.0."""
    if config.rl != "grpo" or config.trl.router_aux_loss_coef is not None:
        return
    coef = shape.config_value("router_aux_loss_coef")
    if shape.config_value("output_router_logits") is None or not coef:
        return
    raise UserError(
        f"`rl: grpo` on a mixture-of-experts model: TRL, at its default "
        f"(`router_aux_loss_coef` null), adds the model's coefficient ({coef}) x the router "
        "load-balancing loss to the GRPO loss; longctx trains the GRPO loss alone, so the "
        "run would differ from TRL's.",
        where="trl.router_aux_loss_coef",
        fix="set `trl.router_aux_loss_coef: 0.0` to train the GRPO loss alone (the routers "
        "still learn through it).",
    )


def check_query_position_scaling(config: Config, shape: ModelShape, layout: Layout) -> None:
    """Llama 4's attention temperature tuning scales its NoPE layers' queries by
    ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` of ``i = arange(input length)``,
    the token's index in the forward's input. Under SP (and in packed or concatenated rows) a
    rank's input is its slice, so ``i`` is not the token's position in its document, and the
    scale differs from the model's own forward as soon as an index or a position reaches
    ``floor_scale - 1``; below that every scale is 1. One document per row at sp 1 is exact."""
    if not shape.config_value("attn_temperature_tuning"):
        return
    floor = shape.config_value("floor_scale")
    no_rope = shape.config_value("no_rope_layers")  # no_rope_layers[i] = 1: layer i has RoPE
    if not floor or (isinstance(no_rope, list) and all(no_rope)):
        return
    per_rank = -(-config.micro_batch_size * config.sequence_len // layout.sp)
    if max(per_rank, config.sequence_len) < floor:
        return
    if layout.sp == 1 and config.micro_batch_size == 1 and not config.sample_packing:
        return  # every row is one document from index 0: the index is the position
    raise UserError(
        f"the model's NoPE layers scale queries by the token's index in the forward's input "
        f"(attn_temperature_tuning, floor_scale = {floor}), and with sequence_len "
        f"{config.sequence_len} and {per_rank} tokens per rank that index reaches "
        f"floor_scale: under sequence parallelism, packing or concatenated micro-batch rows "
        "it is the index in a rank's slice of a row, not the token's position in its "
        "document, so longctx would train a different model than the one you load.",
        where="sequence_len",
        fix=f"keep sequence_len and the tokens per rank below {floor}, or add "
        "`overrides_of_model_config: {attn_temperature_tuning: false}` to train the model "
        "without temperature tuning.",
    )


def check_prefix_sharing(config: Config, shape: ModelShape, layout: Layout) -> None:
    """Shared pair prompts are a second, fully visible key range per branch document, which
    every strategy and kernel computes (flash-attn's rows on PyTorch's flash op); a window
    or a chunk would clip it."""
    if not config.prefix_sharing:
        return
    attention = model_attention(shape)
    why = ("the model's sliding-window attention" if attention.window else
           "the model's chunked local attention" if attention.chunked else None)
    if why:
        raise UserError(f"`prefix_sharing: true` cannot run with {why}: a shared prompt is a "
                        "key range every answer token sees whole, which a window or a chunk "
                        "would cut.", where="prefix_sharing",
                        fix="set `prefix_sharing: false` for this model.")


def check_sequence_len(config: Config, layout: Layout) -> None:
    sp, tp = layout.sp, layout.tp
    multiple = layout.sequence_len_multiple
    if config.sequence_len % multiple:
        why = (
            f"zigzag sharding cuts a row into 2 x {sp} equal chunks"
            if layout.sharding == "zigzag" and sp > 1
            else f"each of the {sp} ranks gets an equal slice of a row"
        ) + (f", and each SP shard is split once more into {tp} sequence slices for the TP "
             "ranks" if tp > 1 else "")
        lower = config.sequence_len // multiple * multiple
        raise UserError(
            f"`sequence_len` = {config.sequence_len} is not a multiple of {multiple}: {why}.",
            fix=f"set `sequence_len` to a multiple of {multiple}, e.g. {max(lower, multiple)} "
            f"or {lower + multiple}.",
        )


def generation_steps(config: Config, dp: int) -> int:
    """`rl: grpo`: micro-batches of each data-parallel group in one generation batch (TRL's
    `steps_per_generation`), a multiple of the accumulation: longctx rolls out whole optimizer
    steps, one generation batch feeding `steps_per_generation / gradient_accumulation_steps`
    of them. Raises UserError for a batch that does not split so."""
    trl, accumulation = config.trl, config.gradient_accumulation_steps
    key = "steps_per_generation" if trl.steps_per_generation is not None else (
        "generation_batch_size")
    try:
        steps = trl.generation_steps(dp, config.micro_batch_size, accumulation)
    except ValueError as e:
        raise UserError(str(e), where=f"trl.{key}") from None
    if steps % accumulation:
        raise UserError(
            f"`trl.{key}: {getattr(trl, key)}` makes {steps} micro-batches per generation "
            f"batch at {dp} data-parallel group(s), not a multiple of "
            f"`gradient_accumulation_steps: {accumulation}`: longctx splits one generation "
            "batch over whole optimizer steps (TRL would start a new one inside a step).",
            where=f"trl.{key}",
            fix=f"make it {accumulation} x k micro-batches per group (steps_per_generation "
            f"{accumulation}, {2 * accumulation}, ...), or lower gradient_accumulation_steps.")
    return steps


def _resolve_kernel(config: Config, platform: Platform | None, ring: int,
                    shape: ModelShape | None, ring_attn_func: str,
                    sharding: str) -> tuple[str, str]:
    """The attention kernel that will run, and why (`kernel_choice.choose_kernel` decides).
    Without a platform no machine is asked: an explicit kernel is kept as written."""
    if platform is None:
        requested = config.attention_kernel
        return ("torch", "no machine asked") if requested == "auto" else (requested, "requested")
    try:
        choice = choose_kernel(
            config.attention_kernel, platform=platform, dtype=config.dtype,
            model=model_attention(shape), sharding=sharding,
            ring_attn_func=ring_attn_func, ring=ring, packed=config.sample_packing,
        )
    except KernelError as err:
        raise UserError(err.message, where="attention_kernel", fix=err.fix) from None
    return choice.kernel, choice.reason


def model_attention(shape: ModelShape | None) -> ModelAttention:
    """The model's attention as the kernel choice sees it (nothing known without a shape).

    ``head_dim`` is what a flash kernel computes on: the larger of the q/k and the value head
    dims (multi-head latent attention pads the smaller side, see ``latent_head_dims``)."""
    if shape is None:
        return ModelAttention()
    dims = latent_head_dims(shape)
    return ModelAttention(head_dim=max(dims) if dims else shape.head_dim,
                          softcap=attention_softcap(shape) is not None,
                          sinks=shape.attention_sinks, window=shape.sliding_window,
                          chunked=chunked_attention(shape))


def latent_head_dims(shape: ModelShape) -> tuple[int, int] | None:
    """(q/k head dim, value head dim) of multi-head latent attention (DeepSeek: q/k =
    ``qk_nope_head_dim + qk_rope_head_dim``, v = ``v_head_dim``), or None when they are one."""
    nope, rope, v = (shape.config_value(k) for k in
                     ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if not all(isinstance(x, int) and x > 0 for x in (nope, rope, v)):
        return None
    return (nope + rope, v) if nope + rope != v else None


def chunked_attention(shape: ModelShape) -> bool:
    """Some layer attends within chunks (Llama 4: `attention_chunk_size`, layer type
    `chunked_attention`)."""
    types = shape.config_value("layer_types")
    return bool(shape.config_value("attention_chunk_size")) and (
        types is None or "chunked_attention" in types)


def rollout_decoding_note(config: Config, shape: ModelShape) -> str | None:
    """`rl: grpo` on a model whose decode steps cannot attend a cached, sharded prompt (a
    window or chunk, layers that mix tokens outside attention): what its rollouts cost."""
    if config.rl != "grpo":
        return None
    why = ("its layers attend within a sliding window" if shape.sliding_window else
           "its layers attend within chunks" if chunked_attention(shape) else
           "some layers mix tokens outside attention" if shape.model_type in HYBRID_MODEL_TYPES
           else None)
    if why is None:
        return None
    n = config.trl.max_completion_length
    return (f"rollouts decode {shape.model_type} by one full SP forward per generated token "
            f"({why}; the cached decode keeps no window or scan state): a completion of up to "
            f"{n} tokens costs up to {n} forwards over the prompt and its completions instead "
            "of one prefill and cached steps, about that many times the prefill's time.")


def _check_adapter(config: Config) -> None:
    if config.adapter is None:
        return
    if config.fsdp and config.load_in_8bit:
        # FSDP-QLoRA (4-bit) works: FSDP2 shards the packed weights as plain uint8 tensors and
        # bitsandbytes finds each layer's quantization state on the module again. The 8-bit
        # layer keeps its row scales (SCB) on the weight tensor itself, which FSDP2 replaces.
        raise UserError(
            "FSDP with an 8-bit base (`load_in_8bit`) cannot run: bitsandbytes' 8-bit layers "
            "keep their row scales on the weight tensor, and FSDP2 replaces that tensor with "
            "its gathered copy, which has none (the first forward fails).",
            where="load_in_8bit",
            fix="use `adapter: qlora` (a 4-bit base, which FSDP shards), or turn FSDP off "
            "(fsdp, fsdp_config, deepspeed, dp_shard_size) for the 8-bit base.",
        )
    if config.tensor_parallel_size > 1 and (config.load_in_4bit or config.load_in_8bit):
        bits = 4 if config.load_in_4bit else 8
        raise UserError(
            f"`tensor_parallel_size` = {config.tensor_parallel_size} with a {bits}-bit base "
            "cannot run: TP turns each linear weight into a DTensor of its rows or columns, "
            "but a bitsandbytes weight is a packed tensor whose quantization state describes "
            "the whole matrix, and bitsandbytes cannot wrap the DTensor (the first forward "
            "fails).",
            where="tensor_parallel_size",
            fix="use `tensor_parallel_size: 1`: sequence parallelism splits the sequence and "
            "FSDP (`fsdp: true`) shards the 4-bit base; or train `adapter: lora` on a "
            "full-precision base with TP.",
        )
    targets = config.lora_target_modules
    if not targets or (isinstance(targets, str) and not targets.strip()):
        raise UserError(
            f"`lora_target_modules` = {targets!r} is empty: LoRA would train nothing.",
            fix="list module names, e.g. `[q_proj, k_proj, v_proj, o_proj]`, or `all-linear`.",
        )


def _advice(
    config: Config, shape: ModelShape, layout: Layout, nproc_per_node: int | None
) -> list[str]:
    """Legal but worth knowing."""
    sp, ulysses, ring = layout.sp, layout.ulysses, layout.ring
    notes = []
    if shape.max_position_embeddings and config.sequence_len > shape.max_position_embeddings:
        notes.append(
            f"sequence_len {config.sequence_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}: positions past it are ones the model never saw; "
            "`rope_scaling: {type: yarn, factor: auto}` extends the context to sequence_len "
            "(docs/context.md)."
        )
    if nproc_per_node and ulysses > nproc_per_node:
        notes.append(
            f"Ulysses groups of {ulysses} span nodes ({nproc_per_node} ranks per node): the "
            "all-to-all crosses the network; hybrid with ulysses_degree <= ranks per node is "
            "usually faster."
        )
    if layout.mode == "hybrid" and ulysses in (1, sp):
        same = "ring" if ulysses == 1 else "ulysses"
        notes.append(f"hybrid with ulysses_degree {ulysses} is the same as `{same}`.")
    if config.activation_offloading and not config.gradient_checkpointing:
        notes.append(
            "activation_offloading without gradient_checkpointing copies every saved tensor "
            "to host memory and back; with checkpointing only each layer's input moves."
        )
    if config.ring_attn_func is None and layout.p2p and ring > 1:
        notes.append(f"ring_attn_func unset: {layout.ring_attn_func}, the sharding that "
                     "spreads causal work evenly on long and packed rows "
                     "(benchmarks/balance.py); `ring_attn_func: varlen_llama3` all-gathers "
                     "K,V instead.")
    if layout.p2p and ring == 1 and sp > 1:
        notes.append(f"ring_attn_func {layout.ring_attn_func} is unused: there is no ring "
                     f"({layout.mode} over all {sp} ranks).")
    if layout.p2p and layout.heads_k_stride != 1 and ring > 1:
        notes.append("heads_k_stride is unused by a P2P ring: each block carries all its KV "
                     "heads.")
    dims = latent_head_dims(shape)
    if dims and layout.kernel in ("flash", "torch_flash"):
        qk, v = dims
        notes.append(
            f"multi-head latent attention: flash attention takes one head dim for q, k and v, "
            f"so the {'values' if v < qk else 'queries and keys'} are padded with zeros from "
            f"{min(qk, v)} to {max(qk, v)} dims inside attention (exact; that much more "
            "attention memory"
            + (", and communication in a flash-attn ring)." if layout.kernel == "flash"
               else ").")
        )
    if ulysses > shape.num_key_value_heads:
        notes.append(
            f"KV heads ({shape.num_key_value_heads}) are replicated to {ulysses} Ulysses ranks."
        )
    return notes

"""The parallel section: how the ranks split the work (sequence, tensor and data
parallelism, FSDP2), and its rules: the `Layout` a config runs on a world, the heads and
lengths each layout needs, tensor parallelism's limits, and the plan's rows about them.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from longctx_cli.config.sections.base import Section, StrictModel
from longctx_cli.config.sections.model import latent_head_dims, model_attention
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.units import DTYPE_BYTES
from longctx_cli.errors import UserError
from longctx_cli.families import TP_FAMILIES, family
from longctx_cli.kernel_choice import KernelError, KernelRequest, Platform, choose_kernel
from longctx_cli.layout import (
    P2P_SHARDING,
    HeadSplit,
    Layout,
    LayoutError,
    Mode,
    RingAttnFunc,
    Sharding,
    check_world,
    data_parallel_degrees,
    default_ring,
    divisors,
    head_chunk_counts,
    head_split,
    largest_share,
    ulysses_degree_for,
)


class FsdpConfig(StrictModel):
    """Axolotl's `fsdp_config:` (keys with or without the older `fsdp_` prefix)."""

    offload_params: bool = Field(False, description="Keep sharded parameters in host memory.")
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3); false = ZeRO-2."
    )
    activation_checkpointing: bool = Field(False, description="Same as gradient_checkpointing.")
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"] | None = (
        None
    )
    final_state_dict_type: (
        Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"] | None
    ) = None
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"] | None = None
    transformer_layer_cls_to_wrap: str | None = None
    min_num_params: int | None = None
    fsdp_version: int | None = None
    sync_module_states: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    cpu_offload_pin_memory: bool | None = None
    use_orig_params: bool | None = None
    mixed_precision_policy: str | None = None
    limit_all_gathers: bool | None = None
    backward_prefetch: str | None = None
    forward_prefetch: bool | None = None
    sharding_strategy: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _strip_prefix(cls, data: Any) -> Any:
        # Axolotl's first generation wrote `fsdp_offload_params`, the second `offload_params`.
        if isinstance(data, dict):
            return {
                (k[5:] if isinstance(k, str) and k.startswith("fsdp_") and k != "fsdp_version"
                 else k): v
                for k, v in data.items()
            }
        return data


class ParallelSection(Section):
    title = "parallelism"

    sequence_parallel_degree: int = Field(
        1,
        ge=1,
        validation_alias=AliasChoices("sequence_parallel_degree", "context_parallel_size"),
        description="Ranks that share one sequence (alias: `context_parallel_size`). "
        "Must divide the world size.",
    )
    sequence_parallel_mode: Mode = Field(
        "ring",
        description="ring: every rank keeps its queries and sees the others' K,V through the "
        "ring algorithm `ring_attn_func` (unset: batch_stripe); ulysses: all-to-all over "
        "heads; hybrid: ulysses inside groups of `ulysses_degree`, ring across them.",
    )
    ulysses_degree: int | None = Field(
        None,
        ge=1,
        description="hybrid: ranks per Ulysses group (must divide `sequence_parallel_degree`).",
    )
    ulysses_head_chunks: int | None = Field(
        None,
        ge=1,
        description="ulysses: the heads are cut into this many chunks (whole KV-head groups) "
        "and each chunk's all-to-all, attention and return run alone, forward and backward, "
        "so one chunk's q, k, v and output exist in the head layout at a time. Unset: the "
        "plan picks the fewest chunks whose head-layout tensors stay under "
        "64 MiB (1 for short rows); validate shows it. Exact at every count.",
    )
    heads_k_stride: int = Field(
        1,
        ge=1,
        description="varlen_llama3 ring: KV heads gathered per communication step; must "
        "divide the model's `num_key_value_heads`. Larger = fewer, bigger messages and more "
        "memory. Written (even at its default 1) while `ring_attn_func` is unset, it picks "
        "varlen_llama3 over batch_stripe, as in Axolotl; validate's plan says why.",
    )
    ring_attn_func: (
        RingAttnFunc | None
    ) = Field(
        None,
        description="Ring algorithm. varlen_llama3: all-gather K,V (in `heads_k_stride` "
        "chunks); batch_ring / batch_zigzag / batch_stripe: pass K/V blocks rank to rank "
        "(two blocks per rank, not the whole sequence) on a contiguous / zigzag / stripe "
        "layout, which sets `sp_sharding`. Unset: batch_stripe (the balanced layout) for "
        "`sequence_parallel_mode: ring` without TP, `sp_sharding`, `heads_k_stride` (even "
        "at 1) or `attention_kernel: flash`; varlen_llama3 otherwise.",
    )
    sp_sharding: Sharding | None = Field(
        None,
        description="How a row is split across the SP group (unset: the layout "
        "`ring_attn_func` names: stripe for the default batch_stripe, contiguous for "
        "varlen_llama3). contiguous or zigzag with `ring_attn_func` unset picks varlen_llama3. "
        "zigzag and stripe (token i on "
        "rank i % sp, batch_stripe only) balance causal work (torch and torch_flash kernels; "
        "flash with the P2P rings); contiguous is what the flash kernel's llama3 ring expects.",
    )
    attention_kernel: KernelRequest = Field(
        "auto",
        description="flash: ring-flash-attn + flash-attn (CUDA, bf16/fp16, contiguous); "
        "torch_flash: PyTorch's own flash-attention op (CUDA, bf16/fp16, every sharding, no "
        "extra package); cudnn: PyTorch's own cuDNN attention ops (CUDA sm90/sm100, "
        "bf16/fp16, no window or softcap; contract-tested, not measured); fa4: flash-attn 4 "
        "(optional pre-release `flash-attn-4`, sm90/sm100, bf16/fp16, no softcap; "
        "contract-tested, not measured); torch: pure PyTorch (CPU, or CUDA through tiled "
        "score matmuls); auto: flash when installed and applicable, else torch_flash on "
        "CUDA, else torch (never cudnn or fa4).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Megatron-style tensor parallelism with sequence-sharded activations "
        "(TP-sp) over this many consecutive ranks; the world is dp x tensor_parallel_size x "
        "sequence_parallel_degree. Heads, KV heads and intermediate size must divide by it.",
    )
    fsdp: bool = Field(
        False,
        description="Shard parameters, gradients and optimizer state with FSDP2 (also turned "
        "on by `fsdp_version`/`fsdp_config`, `deepspeed` ZeRO >= 1 or `dp_shard_size` > 1).",
    )
    fsdp_version: int | None = Field(
        None, ge=1, le=2, description="Axolotl's FSDP generation; both run as FSDP2 here."
    )
    fsdp_config: FsdpConfig | None = Field(
        None,
        description="FSDP options: offload_params, reshard_after_forward, "
        "activation_checkpointing (others accepted, see docs/axolotl.md).",
    )
    deepspeed: str | dict[str, Any] | None = Field(
        None,
        description="A DeepSpeed JSON (path or mapping), mapped onto FSDP2: ZeRO-3 -> full "
        "shard, ZeRO-1/2 -> no parameter resharding, CPU offload -> offload_params.",
    )
    dp_shard_size: int | None = Field(
        None, ge=1, description="Ranks that shard the weights (FSDP); checked against the world."
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Axolotl's expert parallelism (its experts split over this many ranks). "
        "longctx has no expert all-to-all: FSDP2 shards every weight, experts included, over "
        "`dp_shard_size` x this many ranks (or the whole data-parallel world), which trains "
        "the same model with the experts sharded at least as finely.",
    )
    dp_replicate_size: int | None = Field(
        None, ge=1, description="Replicas of the sharded weights (HSDP when > 1 with FSDP)."
    )
    world_size: int | None = Field(
        None,
        ge=1,
        description="Number of ranks assumed by `validate` when neither --nproc-per-node "
        "nor a torchrun environment says.",
    )

    @model_validator(mode="after")
    def _ring_layout(self) -> ParallelSection:
        # A named ring or sharding is resolved here, once (a P2P ring's name fixes its
        # sharding; a contradiction is refused at its line). Neither named: both stay unset
        # until the plan picks the default ring (`layout`).
        try:
            if self.ring_attn_func is not None or self.sp_sharding is not None:
                self.ring_attn_func, self.sp_sharding = default_ring(
                    self.sequence_parallel_mode, self.tensor_parallel_size,
                    self.ring_attn_func, self.sp_sharding,
                    "heads_k_stride" in self.model_fields_set, self.attention_kernel)
        except LayoutError as err:
            raise ValueError(f"{err.message[:-1]}: {err.fix[:-1]}") from None
        return self

    @property
    def stride_given(self) -> bool:
        """`heads_k_stride` was written (even at its default): it picks varlen_llama3."""
        return "heads_k_stride" in self.model_fields_set


def fold_sharding(parallel: ParallelSection, notes: list[tuple[str, str]]) -> bool:
    """Axolotl's ways of asking for FSDP (`deepspeed`, `fsdp_config`, `fsdp_version`,
    `dp_shard_size`) folded into `fsdp` and `fsdp_config`, with the plan's notes; returns
    whether `fsdp_config` asks for activation checkpointing."""
    if parallel.deepspeed is not None and (parallel.fsdp_config is not None
                                           or parallel.fsdp_version):
        raise ValueError("`deepspeed` and `fsdp_config`/`fsdp_version` both choose the "
                         "sharding; keep one")
    if parallel.deepspeed is not None:
        from longctx_cli.config.axolotl import map_deepspeed

        ds = map_deepspeed(parallel.deepspeed)  # MappingProblem is a ValueError
        notes.append(("deepspeed", ds.note()))
        if ds.fsdp:
            parallel.fsdp = True
            parallel.fsdp_config = FsdpConfig(
                reshard_after_forward=ds.reshard_after_forward,
                offload_params=ds.offload_params or ds.offload_optimizer,
            )
    elif parallel.fsdp_config is not None or parallel.fsdp_version:
        parallel.fsdp = True
        fc = parallel.fsdp_config
        if parallel.fsdp_version == 1 or (fc and fc.fsdp_version == 1):
            notes.append(("fsdp_version", "1 runs as FSDP2 (same sharding)"))
    if parallel.expert_parallel_size > 1:
        # Axolotl's world is expert_parallel_size x dp_shard_size: here both axes shard.
        ep, shard = parallel.expert_parallel_size, parallel.dp_shard_size or 1
        parallel.fsdp = True
        notes.append(("expert_parallel_size", (
            f"{ep}: longctx has no expert all-to-all; FSDP2 shards every weight, experts "
            f"included, over at least {ep * shard} ranks (expert_parallel_size x "
            "dp_shard_size): the same training, experts sharded at least as finely")))
    if parallel.dp_shard_size is not None and parallel.dp_shard_size > 1:
        parallel.fsdp = True
    return parallel.fsdp_config is not None and parallel.fsdp_config.activation_checkpointing


# ---- the layout: degrees, sharding, ring and kernel ----------------------------------------


# The plan's default `ulysses_head_chunks`: the fewest chunks whose head-layout tensor (the
# group's tokens for one chunk's heads on one rank) stays under this.
HEAD_CHUNK_TARGET_BYTES = 64 * 2**20


def head_chunks_for(parallel: ParallelSection, sp: int, tp: int, kernel: str,
                    shape: ModelShape | None, sequence_len: int, dtype: str) -> int:
    """`ulysses_head_chunks` as written, or the plan's pick for a Ulysses layout (1 for
    every other layout, for flash-attn's Ulysses, and without a model to count heads of)."""
    if parallel.ulysses_head_chunks is not None:
        return parallel.ulysses_head_chunks
    if parallel.sequence_parallel_mode != "ulysses" or sp == 1 or kernel == "flash" or (
            shape is None):
        return 1
    local = tp_local_shape(shape, tp)
    layers = local.layer_heads or ((local.num_attention_heads, local.num_key_value_heads, 0),)
    fitting = set.intersection(*(set(head_chunk_counts(h, kv, sp)) for h, kv, _ in layers))
    if not fitting:
        return 1  # check_heads refuses these heads with its own reason
    def chunk_bytes(c: int) -> int:  # one chunk's head layout on the rank with most heads
        most = max(largest_share(h // c, kv // c, sp)[0] for h, kv, _ in layers)
        return sequence_len * most * local.head_dim * DTYPE_BYTES.get(dtype, 4)

    small = [c for c in sorted(fitting) if chunk_bytes(c) <= HEAD_CHUNK_TARGET_BYTES]
    return small[0] if small else max(fitting)


def parallel_layout(
    parallel: ParallelSection, world: int, platform: Platform | None, world_source: str,
    shape: ModelShape | None, dtype: str, packed: bool, sequence_len: int = 0,
) -> Layout:
    """The :class:`Layout` of `parallel` on `world` ranks of `platform`; `dtype` and `packed`
    (sample_packing) are what the kernel choice needs of the rest of the run. `platform`
    None: no machine is asked (an explicit kernel is kept, `auto` is planned as without
    CUDA). `shape`: the model, whose attention the kernel must compute."""
    sp, tp = parallel.sequence_parallel_degree, parallel.tensor_parallel_size
    try:
        check_world(sp, tp, world, world_source)
        ulysses = ulysses_degree_for(parallel.sequence_parallel_mode, sp,
                                     parallel.ulysses_degree)
        if shape is not None and shape.attention_free:
            ring_attn_func, sharding = attention_free_sharding(parallel, shape.model_type)
            kernel, reason = "torch", "no attention layer: the scans run the model's own code"
        else:
            if parallel.ring_attn_func is not None:  # named (or implied by sp_sharding): the
                ring_attn_func, sharding = parallel.ring_attn_func, parallel.sp_sharding
            else:
                ring_attn_func, sharding = default_ring(
                    parallel.sequence_parallel_mode, tp, None, None, parallel.stride_given,
                    parallel.attention_kernel)
            kernel, reason = _resolve_kernel(parallel.attention_kernel, platform,
                                             sp // ulysses, shape, ring_attn_func, sharding,
                                             dtype, packed)
        replicas, shards = data_parallel_degrees(world, sp, tp, parallel.fsdp,
                                                 parallel.dp_replicate_size,
                                                 expert_sharding(parallel, world // (sp * tp)))
        # Fills `world` by construction: the ranks check it again on the real world (mesh).
        return Layout(
            sp=sp, tp=tp, dp_replicate=replicas, dp_shard=shards, fsdp=parallel.fsdp,
            mode=parallel.sequence_parallel_mode, ulysses=ulysses, sharding=sharding,
            ring_attn_func=ring_attn_func, heads_k_stride=parallel.heads_k_stride,
            head_chunks=head_chunks_for(parallel, sp, tp, kernel, shape, sequence_len, dtype),
            kernel=kernel, kernel_reason=reason,
        )
    except LayoutError as err:
        raise UserError(err.message, fix=err.fix, key=err.key) from None


def attention_free_sharding(parallel: ParallelSection, model_type: str) -> tuple[str, str]:
    """``(ring_attn_func, sharding)`` of a model without attention (Mamba, Mamba2,
    Falcon-Mamba): no ring ever runs, so only the sharding matters, contiguous unless the
    config names zigzag (its scans pass their state along the shards: parallel/state_relay.py).
    What cannot apply is refused: a stripe, an attention kernel, Ulysses head chunks."""
    what = f"model type `{model_type}` has no attention layer"
    if parallel.sp_sharding == "stripe":
        raise LayoutError(
            # Both keys name it (a stripe is batch_stripe's); the plan's fix search would try
            # other shardings under the same ring, so the fix below is the one offered.
            "ring_attn_func",
            f"`sp_sharding: stripe` (`ring_attn_func: batch_stripe`), but {what}: its scans "
            "carry a document across a shard boundary by passing their state to the next rank "
            "(or, where the scan takes no starting state, by rerunning the document's prefix), "
            "and a stripe (token i on rank i % sp) puts a boundary after every token, so every "
            "rank would rerun nearly its whole documents and the scans would not shrink with "
            "sp.",
            "leave `sp_sharding` and `ring_attn_func` out (contiguous shards, the default for "
            "such a model), or set `sp_sharding: zigzag`.")
    if parallel.attention_kernel not in ("auto", "torch"):
        raise LayoutError(
            "attention_kernel",
            f"`attention_kernel: {parallel.attention_kernel}`, but {what} for the kernel to "
            "compute (its scans run the model's own code).",
            "leave `attention_kernel` out (or `auto`).")
    if parallel.ulysses_head_chunks is not None:
        raise LayoutError(
            "ulysses_head_chunks",
            f"`ulysses_head_chunks: {parallel.ulysses_head_chunks}`, but {what}, so no heads "
            "to cut into chunks.", "leave `ulysses_head_chunks` out.")
    sharding = parallel.sp_sharding or "contiguous"
    # The ring of that sharding by name only: the plan shows it, no attention calls it.
    ring = parallel.ring_attn_func or "varlen_llama3"
    return (ring if P2P_SHARDING.get(ring, sharding) == sharding else "varlen_llama3"), sharding


def expert_sharding(parallel: ParallelSection, data_parallel: int) -> int | None:
    """`dp_shard_size` with Axolotl's expert axis folded in (`expert_parallel_size` x
    `dp_shard_size` ranks shard the weights), checked against the data-parallel ranks."""
    ep, shard = parallel.expert_parallel_size, parallel.dp_shard_size
    if ep == 1:
        return shard
    if data_parallel % (ep * (shard or 1)):
        raise LayoutError(
            "expert_parallel_size",
            f"`expert_parallel_size` = {ep}" + (f" x dp_shard_size {shard}" if shard else "")
            + f" does not divide the {data_parallel} data-parallel ranks.",
            "make expert_parallel_size (x dp_shard_size) divide the world / "
            "sequence_parallel_degree / tensor_parallel_size.")
    return ep * (shard or 1)


def _resolve_kernel(requested: str, platform: Platform | None, ring: int,
                    shape: ModelShape | None, ring_attn_func: str, sharding: str, dtype: str,
                    packed: bool) -> tuple[str, str]:
    """The attention kernel that will run, and why (`kernel_choice.choose_kernel` decides).
    Without a platform no machine is asked: an explicit kernel is kept as written."""
    if platform is None:
        return ("torch", "no machine asked") if requested == "auto" else (requested, "requested")
    try:
        choice = choose_kernel(
            requested, platform=platform, dtype=dtype, model=model_attention(shape),
            sharding=sharding, ring_attn_func=ring_attn_func, ring=ring, packed=packed,
        )
    except KernelError as err:
        raise UserError(err.message, where="attention_kernel", fix=err.fix,
                        key="attention_kernel") from None
    return choice.kernel, choice.reason


def check_heads(layout: Layout, shape: ModelShape) -> None:
    """The heads one TP rank holds fit the layout's Ulysses split and heads_k_stride."""
    if shape.attention_free:
        return  # no heads to split
    local = tp_local_shape(shape, layout.tp)
    try:
        for heads, kv, _ in local.layer_heads or [(local.num_attention_heads,
                                                   local.num_key_value_heads, 0)]:
            layout.check_heads(heads, kv)  # every layer's heads, where the layers differ
    except LayoutError as err:
        raise UserError(err.message, fix=err.fix, key=err.key) from None


def check_sequence_len(sequence_len: int, layout: Layout) -> None:
    """A row splits into equal slices for the layout's ranks."""
    sp, tp = layout.sp, layout.tp
    multiple = layout.sequence_len_multiple
    if sequence_len % multiple:
        why = (
            f"zigzag sharding cuts a row into 2 x {sp} equal chunks"
            if layout.sharding == "zigzag" and sp > 1
            else f"each of the {sp} ranks gets an equal slice of a row"
        ) + (f", and each SP shard is split once more into {tp} sequence slices for the TP "
             "ranks" if tp > 1 else "")
        lower = sequence_len // multiple * multiple
        raise UserError(
            f"`sequence_len` = {sequence_len} is not a multiple of {multiple}: {why}.",
            fix=f"set `sequence_len` to a multiple of {multiple}, e.g. {max(lower, multiple)} "
            f"or {lower + multiple}.",
        )


def fsdp_detail(parallel: ParallelSection, layout: Layout) -> str:
    """The plan's `fsdp` row."""
    if not layout.fsdp:
        return "no"
    fc = parallel.fsdp_config
    parts = ["FSDP2", "full shard" if fc is None or fc.reshard_after_forward
             else "no parameter resharding (ZeRO-2)"]
    if fc is not None and fc.offload_params:
        parts.append("params offloaded to CPU")
    if layout.dp_replicate > 1:
        parts.append(f"HSDP: {layout.dp_replicate} replicas")
    return ", ".join(parts)


def parallel_notes(layout: Layout, nproc_per_node: int | None) -> list[str]:
    """Legal but worth knowing, about the layout."""
    sp, ulysses = layout.sp, layout.ulysses
    notes = []
    if nproc_per_node and ulysses > nproc_per_node:
        notes.append(
            f"Ulysses groups of {ulysses} span nodes ({nproc_per_node} ranks per node): the "
            "all-to-all crosses the network; hybrid with ulysses_degree <= ranks per node is "
            "usually faster."
        )
    if layout.mode == "hybrid" and ulysses in (1, sp):
        same = "ring" if ulysses == 1 else "ulysses"
        notes.append(f"hybrid with ulysses_degree {ulysses} is the same as `{same}`.")
    return notes


def ring_notes(parallel: ParallelSection, shape: ModelShape, layout: Layout) -> list[str]:
    """Legal but worth knowing, about the ring and the heads."""
    sp, ulysses, ring = layout.sp, layout.ulysses, layout.ring
    if shape.attention_free:
        return [f"model type `{shape.model_type}` has no attention layer: no ring or Ulysses "
                f"all-to-all runs (`sequence_parallel_mode: {layout.mode}` computes the same); "
                f"the row is cut into {layout.sharding} shards, along which its scans pass "
                "their state or rerun document prefixes (token mixing below)."] if sp > 1 else []
    notes = []
    if parallel.ring_attn_func is None and layout.p2p and ring > 1:
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
    split = ulysses_split(shape, layout)
    if split is not None and not split.even:
        notes.append(
            f"the {sum(split.q_counts)} heads do not divide evenly over the Ulysses group of "
            f"{ulysses} (whole KV-head groups, or shares of a replicated KV head's queries): "
            f"the rank with the most ({max(split.q_counts)}) sets the step's attention time "
            "and memory. A Ulysses size dividing the heads and dividing, or divided by, the KV "
            "heads balances them.")
    return notes


def ulysses_split(shape: ModelShape, layout: Layout) -> HeadSplit | None:
    """How the Ulysses group splits the heads one TP rank holds (the layer with the most
    heads, where they differ); None without a Ulysses group or heads it can split."""
    if layout.ulysses == 1 or shape.attention_free:
        return None
    local = tp_local_shape(shape, layout.tp)
    layers = local.layer_heads or ((local.num_attention_heads, local.num_key_value_heads, 0),)
    heads, kv, _ = max(layers)
    try:
        return head_split(heads, kv, layout.ulysses)
    except ValueError:
        return None


# ---- tensor parallelism (TP-sp) -------------------------------------------------------------

def _refuse(what: str, fix: str) -> UserError:
    return UserError(f"`tensor_parallel_size` > 1 with {what}", fix=fix)


def check_tp_config(tp: int, lora_dropout: float | None, tiled_mlp: bool,
                    activation_offloading: bool) -> None:
    """Combinations TP-sp does not (yet) train exactly: refused, never silently wrong.
    `lora_dropout`: the adapter's (None without a LoRA adapter)."""
    if tp == 1:
        return
    if lora_dropout:
        raise _refuse(
            f"`lora_dropout` = {lora_dropout} is not supported: the dropout masks of "
            "activations replicated over the TP group would have to agree across its ranks.",
            "set `lora_dropout: 0`.")
    if tiled_mlp:
        raise _refuse("`tiled_mlp` is not supported (TP already splits the MLP's columns).",
                      "set `tiled_mlp: false`.")
    if activation_offloading:
        raise _refuse("`activation_offloading` is not supported (untested with DTensor "
                      "activations).", "set `activation_offloading: false`.")


def check_tp_model(tp: int, shape: ModelShape) -> None:
    """Heads / KV heads / intermediate size divisible by T; a family TP-sp can shard."""
    if tp == 1:
        return
    if shape.attention_free:
        raise _refuse(
            f"model type `{shape.model_type}` is not supported: it has no attention layer, and "
            "TP-sp shards attention heads and MLP columns (its scans' channels and states "
            "are not split over ranks).",
            "use `tensor_parallel_size: 1` (sequence parallelism + FSDP) for this model.")
    if not family(shape.model_type).tensor_parallel:
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
        layer_heads=tuple((h // tp, k // tp, d) for h, k, d in shape.layer_heads),
    )


def tp_layout_rows(dp: int, sp: int, tp: int, sp_shard_tokens: int) -> list[tuple[str, str]]:
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


def tp_notes(tp: int, nproc_per_node: int | None) -> list[str]:
    """Legal but worth knowing."""
    if tp > 1 and nproc_per_node and tp > nproc_per_node:
        return [f"TP groups of {tp} span nodes ({nproc_per_node} ranks per node): TP-sp moves "
                "activations 8 times per layer over the network; keep tensor_parallel_size "
                "<= ranks per node and use sequence parallelism across nodes."]
    return []



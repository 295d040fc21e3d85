"""Check a config against the world size and the model, and resolve it into a `Plan`.

The plan is what `longctx validate` prints: how ranks are grouped, how many tokens each rank
sees, which attention kernel runs, and a rough per-rank memory estimate. Every rule that can
fail raises a `UserError` naming the key, its value, why it is wrong and how to fix it.

Nothing here imports `torch.distributed`; torch itself is imported only inside the
functions that ask about CUDA, so `longctx --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from longctx_cli.config.memory_estimate import (
    MemoryEstimate,
    attention_buffer_bytes,
    estimate_memory,
    tiled_scores_run,
)
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.rope import check_context, check_rope_settings
from longctx_cli.config.schema import Config
from longctx_cli.config.sections.adapter import adapter_rows, check_adapter
from longctx_cli.config.sections.grpo import (
    check_generation_batch,
    check_grpo_router_aux_loss,
    rollout_decoding_note,
)
from longctx_cli.config.sections.memory import memory_notes
from longctx_cli.config.sections.model import (
    attention_dropout_notes,
    check_attention_dropout,
    check_linearized_experts,
    check_query_position_scaling,
    check_router_aux_loss,
    check_sparse_attention,
    context_note,
)
from longctx_cli.config.sections.objective import check_prefix_sharing, objective_text
from longctx_cli.config.sections.parallel import (
    check_heads,
    check_sequence_len,
    check_tp_config,
    check_tp_model,
    fsdp_detail,
    parallel_layout,
    parallel_notes,
    ring_notes,
    tp_layout_rows,
    tp_notes,
    ulysses_split,
)
from longctx_cli.config.sections.training import optimizer_rows, stop_rows
from longctx_cli.config.sections.vision import (
    CrossAttendedImages,
    TowerRun,
    check_vision,
    cross_rows,
    images_attend_both_ways,
)
from longctx_cli.config.sections.vision import plan_rows as vision_plan_rows
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.units import DTYPE_BYTES, format_count, format_gib
from longctx_cli.config.world import Platform, resolve_world
from longctx_cli.errors import UserError
from longctx_cli.layout import (
    CONCRETE_KERNELS,
    MODES,
    SHARDINGS,
    Layout,
    largest_share,
    ring_reason,
)

if TYPE_CHECKING:
    from rich.table import Table

# ---- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A config resolved against a world size and a model: what a run will do, per rank."""

    world_size: int
    world_source: str
    layout: Layout  # the degrees, sharding, ring and kernel the ranks run
    dtype: str
    adapter: str | None
    sequence_len: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    micro_batch_tokens: int  # per SP group per forward pass
    global_batch_sequences: int  # rows per optimizer step, whole world
    global_batch_tokens: int
    tokens_per_rank_per_forward: int
    tokens_per_rank_per_step: int
    model: ModelShape
    memory: MemoryEstimate
    notes: tuple[str, ...] = field(default_factory=tuple)
    host_is_device: bool = False  # a CPU run: offloading activations frees nothing
    training: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    fsdp_detail: str = ""
    axolotl: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # key -> what we did
    assumed: tuple[str, ...] = field(default_factory=tuple)  # what validate assumed
    # Attention buffers per rank had each ring algorithm been chosen (ring > 1 only).
    attention_buffers_by_ring: tuple[tuple[str, int], ...] = ()
    ring_reason: str = ""  # why that ring (printed next to it): a config key or the default
    vision: tuple[tuple[str, str], ...] = ()  # a vision-language model's tower rows
    # `auto` planned on a machine without CUDA: the kernel the ranks run on CUDA GPUs.
    kernel_on_gpus: str = ""

    def _head_chunk_rows(self) -> list[tuple[str, str]]:
        """Ulysses: the head chunks and what one chunk's head-layout tensor holds."""
        lay, m = self.layout, self.model
        if lay.mode != "ulysses" or lay.sp == 1:
            return []
        local = m.num_attention_heads // lay.tp // lay.head_chunks
        heads = largest_share(local, max(1, m.num_key_value_heads // lay.tp // lay.head_chunks),
                              lay.sp)[0]
        chunk = self.micro_batch_tokens * max(1, heads) * m.head_dim * DTYPE_BYTES.get(
            self.dtype, 4)
        flash = ("; flash-attn keeps every chunk's for its backward" if lay.kernel == "flash"
                 and lay.head_chunks > 1 else "")
        return [("ulysses head chunks", f"{lay.head_chunks} ({heads} head"
                 f"{'s' if heads != 1 else ''} per rank at a time; {format_gib(chunk)} per "
                 f"head-layout tensor{flash})")]

    def _head_split_rows(self) -> list[tuple[str, str]]:
        """Ulysses over heads that do not divide its group: each rank's share."""
        split = ulysses_split(self.model, self.layout)
        return [] if split is None or split.even else [("ulysses heads", split.describe())]

    def to_table(self) -> Table:
        """The plan as a rich Table (what `longctx validate` prints)."""
        from rich.table import Table

        t = Table(title="longctx plan", show_header=False, title_justify="left", min_width=60)
        t.add_column("item", style="bold")
        t.add_column("value", overflow="fold")
        m = self.model
        for section, rows in self._sections(m):
            t.add_row(f"[cyan]{section}[/]", "", end_section=False)
            for name, value in rows:
                t.add_row(f"  {name}", value)
            t.add_section()
        if self.axolotl:
            t.add_row("[cyan]axolotl keys[/]", "")
            for key, what in self.axolotl:
                t.add_row(f"  {key}", what)
            t.add_section()
        for text in self.assumed:
            t.add_row("  assumed", text)
        for note in self.notes:
            t.add_row("  note", note)
        return t

    def _sections(self, m: ModelShape) -> list[tuple[str, list[tuple[str, str]]]]:
        mem, lay = self.memory, self.layout
        split = f"{lay.ulysses} ulysses x {lay.ring} ring"
        return [
            ("model", [
                ("shape", f"{m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
                          f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV heads"),
                ("parameters", f"{format_count(mem.total_params)} "
                               f"({format_count(mem.trainable_params)} trainable"
                               f"{', LoRA' if self.adapter else ''}), {self.dtype}"),
                ("shape from", m.source),
                *([("context", m.context)] if m.context else []),
                *self.vision,
            ]),
            ("parallelism", [
                ("world size", f"{self.world_size} ({self.world_source})"),
                ("data parallel", str(lay.dp)),
                ("sequence parallel", f"{lay.sp} ({lay.mode}: {split})"),
                *self._head_split_rows(),
                *tp_layout_rows(lay.dp, lay.sp, lay.tp,
                                      self.tokens_per_rank_per_forward),
                ("ring_attn_func", lay.ring_attn_func if lay.ring > 1 else "-"),
                *([("why this ring", self.ring_reason)] if lay.ring > 1 else []),
                ("heads_k_stride", str(lay.heads_k_stride) if lay.ring > 1
                 and lay.ring_attn_func == "varlen_llama3" and not m.attention_free else "-"),
                *self._head_chunk_rows(),
                ("sharding", lay.sharding if lay.sp > 1 else "none (sp = 1)"),
                ("attention kernel", f"{lay.kernel} ({lay.kernel_reason})" + (
                    f"; on the run's CUDA GPUs the ranks run {self.kernel_on_gpus}"
                    if self.kernel_on_gpus else "")),
                ("fsdp", self.fsdp_detail),
            ]),
            ("training", list(self.training)),
            ("batch", [
                ("micro batch", f"{self.micro_batch_size} x {self.sequence_len:,} = "
                                f"{self.micro_batch_tokens:,} tokens per SP group"
                 if self.micro_batch_tokens == self.micro_batch_size * self.sequence_len else
                 f"{self.micro_batch_size} completions in rows of up to "
                 f"{self.micro_batch_tokens:,} tokens per SP group (each prompt once)"),
                ("global batch", f"{self.global_batch_sequences} sequences = "
                                 f"{self.global_batch_tokens:,} tokens per step"),
                ("tokens per rank", f"{self.tokens_per_rank_per_forward:,} per forward, "
                                    f"{self.tokens_per_rank_per_step:,} per step"),
            ]),
            ("memory per rank (rough)", [
                *[(name, format_gib(value)) for name, value in mem.parts()],
                *[(f"  with {f} instead", f"SP attention buffers {format_gib(v)}")
                  for f, v in self.attention_buffers_by_ring
                  if (f == "varlen_llama3") != (lay.ring_attn_func == "varlen_llama3")],
                ("total", f"[bold]{format_gib(mem.total)}[/] at {mem.peak_moment}"),
                ("  the step's moments", ", ".join(f"{name} {format_gib(value)}"
                                                   for name, value in mem.moments())),
                *([("rollouts", f"{format_gib(mem.rollout_total)}: the full weights gathered "
                                f"once per rollout (+{format_gib(mem.rollout_weights)}); "
                                "trl.ds3_gather_for_generation: false gathers a layer per "
                                "token instead, the data-parallel groups in lockstep")]
                  if mem.rollout_weights else []),
            ]),
        ]


def _training_rows(config: Config) -> tuple[tuple[str, str], ...]:
    """Objective, optimizer, schedule, precision and cadence as the run will use them."""
    model = config.model
    rows = [
        ("objective", objective_text(config.objective, config.trl, config.lora.adapter,
                                     bool(config.lora.lora_model_dir))),
        *optimizer_rows(config.training),
        ("precision", model.dtype + (", tf32 matmuls" if model.tf32 else "")),
        *adapter_rows(config.lora, model.dtype),
        ("checkpoints", config.output.save_text()),
        ("eval loss" + (" + rewards" if config.objective.rl else ""), _eval_text(config)),
        *stop_rows(config.training),
        ("logging", config.output.trackers_text()),
    ]
    return tuple(rows)


def _eval_text(config: Config) -> str:
    """When the eval loss is computed; eval data that is never evaluated is said so."""
    cadence = config.eval.cadence_text()
    held = ("`eval_datasets`" if config.data.eval_datasets else
            f"`val_set_size: {config.data.val_set_size:g}` (rows held out of training)"
            if config.data.val_set_size else "")
    if cadence not in ("none", "never") or not held:
        return cadence
    return (f"{cadence}: {held} is never evaluated; set `eval_steps` or `evals_per_epoch` to "
            "evaluate it")


def layout_for(
    config: Config, world: int, platform: Platform | None, world_source: str = "given",
    shape: ModelShape | None = None,
) -> Layout:
    """The run's :class:`Layout`: the degrees, sharding, ring and kernel of `config` on
    `world` ranks of `platform`. `validate` and every rank build it here, so they agree
    (`sections.parallel.parallel_layout`)."""
    return parallel_layout(config.parallel, world, platform, world_source, shape,
                           config.model.dtype, config.data.sample_packing,
                           config.data.sequence_len)


def check_without_model(
    config: Config, world_size: int, world_source: str = "given",
    platform: Platform | None = None,
) -> Layout:
    """The rules that need no model (cheap: run them first); returns the layout.

    Without a `platform` no machine is asked (the rules it checks do not depend on one).
    """
    layout = layout_for(config, world_size, platform, world_source)
    lora, memory = config.lora, config.memory
    check_tp_config(layout.tp, lora.lora_dropout if lora.adapter == "lora" else None,
                    memory.tiled_mlp, memory.activation_offloading)
    check_sequence_len(config.data.sequence_len, layout)
    if config.objective.rl == "grpo":
        check_generation_batch(config.trl, layout.dp, config.training.micro_batch_size,
                               config.training.gradient_accumulation_steps)
    check_rope_settings(config.model.rope_scaling)
    # No micro_batch_size rule: varlen_llama3 takes packed rows, and micro-batch rows are
    # concatenated into one row whose documents never attend across a row boundary.
    check_adapter(lora, config.parallel.fsdp, layout.tp)
    return layout


def build_plan(
    config: Config,
    world_size: int,
    model_config: ModelShape | Any,
    *,
    platform: Platform | None = None,
    nproc_per_node: int | None = None,
    world_source: str = "given",
    assume_gpu: bool = False,
) -> Plan:
    """Apply every rule (the first broken one raises UserError) and resolve the plan.

    `assume_gpu` (what `validate` passes): a config that asks for the flash kernel is planned
    for a CUDA machine even where this one has none, and the plan says so.

    `model_config` is a `ModelShape` or a transformers `PretrainedConfig`; `platform`
    defaults to what this machine offers.
    """
    shape = (
        model_config if isinstance(model_config, ModelShape)
        else ModelShape.from_hf_config(model_config)
    )
    model, data, training, parallel = config.model, config.data, config.training, config.parallel
    check_without_model(config, world_size, world_source)
    check_tp_model(parallel.tensor_parallel_size, shape)
    check_sparse_attention(shape)
    check_router_aux_loss(shape)
    check_linearized_experts(model.llama4_linearized_experts, shape,
                             config.lora.load_in_8bit, config.lora.quantize_moe_experts)
    if config.objective.rl == "grpo":
        check_grpo_router_aux_loss(config.trl, shape)
    # A plain dict (no transformers config yet) holds no RoPE settings to check.
    check_context(data.sequence_len, model.rope_scaling, shape.hf_config,
                  shape.max_position_embeddings)
    platform = platform or Platform.detect()
    requested = parallel.attention_kernel
    assumed: list[str] = []
    if assume_gpu and not platform.cuda and requested in ("flash", "torch_flash"):
        # A login node plans a GPU job: plan it for the GPU machine and say so.
        assumed.append(
            "this machine has no CUDA GPU; the plan assumes the run's machines have Ampere or "
            "newer CUDA GPUs" + (" with flash-attn 2 and ring-flash-attn installed"
                                 if requested == "flash" else "") + " (docs/gpu.md)."
        )
        platform = Platform(cuda=True, ring_flash_attn=requested == "flash")
    elif assume_gpu and not platform.cuda and requested in ("cudnn", "fa4"):
        # Kernels for Hopper and newer: plan for one, with the cuDNN torch 2.13 bundles.
        assumed.append(
            "this machine has no CUDA GPU; the plan assumes the run's machines have Hopper "
            "(sm90) CUDA GPUs with torch's bundled cuDNN"
            + (" and flash-attn 4 installed" if requested == "fa4" else "")
            + " (docs/gpu.md).")
        platform = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0),
                            cudnn_version=91800, fa4=requested == "fa4")
    layout = layout_for(config, world_size, platform, world_source, shape)
    on_gpus = ""
    if not assumed and not platform.cuda and requested == "auto":
        # The same decision on a GPU machine, without and with flash-attn.
        bare, full = (layout_for(config, world_size, Platform(cuda=True, ring_flash_attn=has),
                                 world_source, shape).kernel for has in (False, True))
        assumed.append(
            "no CUDA here, so `attention_kernel: auto` resolves to torch; on Ampere or newer "
            f"CUDA GPUs it resolves to {bare}"
            + ("" if full == bare else f", or {full} with flash-attn installed")
            + " (same attention)."
        )
        on_gpus = bare + ("" if full == bare else f" ({full} with flash-attn installed)")
    check_heads(layout, shape)  # SP works on the heads TP left on the rank
    check_attention_dropout(shape, layout, config.objective.prefix_sharing)
    check_query_position_scaling(shape, layout, data.sequence_len, training.micro_batch_size,
                                 config.objective.splits_rows)
    check_prefix_sharing(config.objective, shape)
    sp = layout.sp
    tiled = tiled_scores_run(layout.kernel, platform.cuda, shape, layout.p2p and layout.ring > 1,
                             images_attend_both_ways(config.vision, shape.hf_config))
    memory, estimate_notes = estimate_memory(
        config, shape, world_size, layout, host_is_device=not platform.cuda,
        tiled_scores=tiled,
    )
    tower = check_vision(config.vision, shape.hf_config, layout,
                         streamed=bool(data.pretraining_dataset), rl=config.objective.rl,
                         model_type=shape.model_type)
    vision_rows: tuple[tuple[str, str], ...] = ()
    if tower is not None:
        cross = CrossAttendedImages.of(shape.hf_config)
        lora = config.lora
        adapted = (cross.adapted_kv(lora.lora_target_modules)
                   if cross is not None and lora.adapter is not None else (False, False))
        run = TowerRun(dtype=model.dtype, frozen=config.vision.freeze_mm_modules,
                       adapter=lora.adapter, row_tokens=config.row_tokens,
                       checkpointed=config.memory.gradient_checkpointing,
                       images_per_row=config.vision.images_per_row or 1,
                       adapted_kv=adapted,
                       lora_r=lora.lora_r, lora_dropout=bool(lora.lora_dropout))
        memory = replace(memory, vision_tower=sum(tower.memory(run, layout)))
        vision_rows = tuple(vision_plan_rows(tower, run, layout))
        if cross is not None:
            states, kept, backward = cross.memory(run, layout)
            memory = replace(memory, cross_images=states + kept,
                             cross_images_backward=backward)
            tiles = int(shape.hf_config.vision_config.max_num_tiles)
            vision_rows += tuple(cross_rows(cross, run, layout, tiles,
                                            config.vision.images_per_row is None))

    dp = layout.dp
    row_tokens = config.row_tokens
    accumulation = training.gradient_accumulation_steps
    sequences = training.micro_batch_size * accumulation * dp
    notes = []
    if "built-in table" in shape.source:
        notes.append(
            "the model's config was not downloaded: its shape comes from longctx's built-in "
            "table of known models."
        )
    notes += context_note(shape, data.sequence_len)
    notes += parallel_notes(layout, nproc_per_node)
    notes += memory_notes(config.memory)
    notes += ring_notes(parallel, shape, layout)
    notes += attention_dropout_notes(shape, layout, data.sequence_len, shape.attention_sinks
                                     or images_attend_both_ways(config.vision, shape.hf_config))
    notes += estimate_notes
    if config.objective.rl == "grpo":
        notes += rollout_decoding_note(config.trl, shape)
    notes += tp_notes(layout.tp, nproc_per_node)
    return Plan(
        world_size=world_size,
        world_source=world_source,
        layout=layout,
        dtype=model.dtype,
        adapter=config.lora.adapter,
        sequence_len=data.sequence_len,
        micro_batch_size=training.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        micro_batch_tokens=row_tokens,
        global_batch_sequences=sequences,
        global_batch_tokens=row_tokens * accumulation * dp,
        tokens_per_rank_per_forward=row_tokens // sp,
        tokens_per_rank_per_step=row_tokens // sp * accumulation,
        model=shape,
        memory=memory,
        notes=tuple(notes),
        host_is_device=not platform.cuda,
        training=_training_rows(config),
        vision=vision_rows,
        fsdp_detail=fsdp_detail(parallel, layout),
        axolotl=tuple(config.axolotl_notes),
        assumed=tuple(assumed),
        kernel_on_gpus=on_gpus,
        attention_buffers_by_ring=_buffers_by_ring(config, shape, layout),
        ring_reason=("none runs: the model has no attention layer (the ring's name only "
                     "fixes the sharding)" if shape.attention_free else
                     ring_reason(parallel.sequence_parallel_mode,
                                 parallel.tensor_parallel_size,
                                 parallel.ring_attn_func is not None, parallel.stride_given,
                                 parallel.attention_kernel)),
    )


def _buffers_by_ring(
    config: Config, shape: ModelShape, layout: Layout
) -> tuple[tuple[str, int], ...]:
    """What each ring algorithm would hold per rank here (the P2P rings hold the same)."""
    if layout.ring == 1:
        return ()
    local = config.training.micro_batch_size * config.data.sequence_len // layout.sp
    return tuple(
        (f, attention_buffer_bytes(config, shape, layout, local, f))
        for f in ("varlen_llama3", "batch_*")
    )


def plan_for(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None, *,
    assume_gpu: bool = False,
) -> Plan:
    """The one plan of a run: resolve the world (flags, else torchrun's WORLD_SIZE, else the
    config), read the model once, and apply every rule on this machine. `validate`, every
    launcher and every rank build their plan here (through `preflight.check_run`).

    A broken rule's fix is re-checked before it is printed (`recheck_fix`: the values of its
    key that pass every rule here), and the plan goes on with the first of them to find the
    config's other problems: all of them come in one UserError.

    `assume_gpu` (`validate` on a login node): a GPU kernel is planned for a CUDA machine."""
    world, source = resolve_world(config, nproc_per_node, nnodes)
    problems: list[UserError] = []
    shape: ModelShape | None = None
    trial = config
    for _ in range(_MOST_PROBLEMS):
        try:
            check_without_model(trial, world, source)  # fail fast, before transformers
            shape = shape or read_model_config(config)  # the keys tried do not change it
            plan = build_plan(trial, world, shape, nproc_per_node=nproc_per_node,
                              world_source=source, assume_gpu=assume_gpu)
        except UserError as error:
            checked, fixed = recheck_fix(error, trial, world, source, shape, nproc_per_node,
                                         assume_gpu)
            problems.append(checked)
            if fixed is None:
                break
            trial = fixed
            continue
        if not problems:
            return plan
        break
    if len(problems) == 1:
        raise problems[0]
    raise UserError("\n".join([f"{len(problems)} problems in the plan (each found with the "
                               "fixes before it taken):",
                               *(f"  {p}" for p in problems)]))


_MOST_PROBLEMS = 6  # a plan reports at most this many problems at once


def _candidates(key: str, config: Config, world: int, shape: ModelShape | None) -> list[Any]:
    """The values a fix may offer for `key` (each is then tried against every rule)."""
    parallel = config.parallel
    if key == "sequence_parallel_degree":
        return [d for d in range(1, world + 1) if world % d == 0]
    if key == "ulysses_degree":
        sp = parallel.sequence_parallel_degree
        return [None, *(d for d in range(1, sp + 1) if sp % d == 0)]  # None: left out
    if key == "heads_k_stride" and shape is not None:
        kv = shape.num_key_value_heads
        return [d for d in range(1, kv + 1) if kv % d == 0]
    if key == "sp_sharding":
        return list(SHARDINGS)
    if key == "attention_kernel":
        return ["auto", *CONCRETE_KERNELS]
    if key == "sequence_parallel_mode":
        return list(MODES)
    return []


# A broken rule of the first key may be fixed by a value of the others as well.
_FIXED_BY = {
    "sequence_parallel_degree": ("sequence_parallel_degree", "sequence_parallel_mode"),
    "ulysses_degree": ("ulysses_degree", "sequence_parallel_mode"),
    "heads_k_stride": ("heads_k_stride",),
    "sp_sharding": ("sp_sharding", "attention_kernel"),
    "attention_kernel": ("attention_kernel",),
}


def recheck_fix(
    error: UserError, config: Config, world: int, source: str, shape: ModelShape | None,
    nproc_per_node: int | None = None, assume_gpu: bool = False,
) -> tuple[UserError, Config | None]:
    """`error` with a fix whose every value passes every rule for this config on `world`
    ranks, and the config with the first of them (None: no such value, or the error names
    no key whose values can be tried)."""
    keys = _FIXED_BY.get(error.key or "", ())
    if not keys:
        return error, None
    if shape is None:
        try:
            shape = read_model_config(config)
        except UserError:
            return error, None  # the model's config is the problem the plan reports next
    legal: dict[str, list[Any]] = {}
    for key in keys:
        current = _value(config, key)
        for value in _candidates(key, config, world, shape):
            trial = config.model_copy(update={key: value})
            if value != current and _passes(trial, world, source, shape, nproc_per_node,
                                            assume_gpu, frozenset(keys)):
                legal.setdefault(key, []).append(value)
    offers = [f"`{key}` to {_or(['null' if v is None else str(v) for v in values])}"
              for key, values in legal.items()]
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    fix = (f"set {'; or '.join(offers)} (each checked against every rule for this config on "
           f"{ranks})" if offers else
           f"no other value of {_or([f'`{k}`' for k in keys])} passes every rule for this "
           f"config on {ranks}")
    group = config.parallel.sequence_parallel_degree * config.parallel.tensor_parallel_size
    launch = -(-world // group) * group  # the next world this config's groups fill
    if launch != world and _passes(config, launch, "launched", shape, None, assume_gpu):
        fix += f", or launch a multiple of {group} ranks"
    checked = UserError(error.message, where=error.where, fix=fix + ".", key=error.key)
    if not legal:
        return checked, None
    first_key, values = next(iter(legal.items()))
    return checked, config.model_copy(update={first_key: values[0]})


def _value(config: Config, key: str) -> Any:
    return getattr(config.parallel, key)


def _passes(config: Config, world: int, source: str, shape: ModelShape,
            nproc_per_node: int | None, assume_gpu: bool, tried: frozenset[str] = frozenset(),
            depth: int = 3) -> bool:
    """Whether `config` passes every rule, or would once the other keys' problems it has are
    fixed too (each by a value of its own keys, never by the keys already tried): a value that
    is right for its own rule is offered even where the config has other problems."""
    try:
        check_without_model(config, world, source)
        build_plan(config, world, shape, nproc_per_node=nproc_per_node, world_source=source,
                   assume_gpu=assume_gpu)
    except UserError as error:
        keys = [k for k in _FIXED_BY.get(error.key or "", ()) if k not in tried]
        if depth == 0 or not keys or error.key in tried:
            return False
        return any(
            _passes(config.model_copy(update={key: value}), world, source, shape,
                    nproc_per_node, assume_gpu, tried | {error.key or key, *keys}, depth - 1)
            for key in keys for value in _candidates(key, config, world, shape)
            if value != _value(config, key))
    return True


def _or(items: list[str]) -> str:
    """`a, b or c`."""
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else items[0]

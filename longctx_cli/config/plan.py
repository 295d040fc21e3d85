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

from longctx_cli.config import tp_rules
from longctx_cli.config.memory_estimate import (
    MemoryEstimate,
    attention_buffer_bytes,
    estimate_memory,
    format_count,
    format_gib,
    tiled_scores_run,
)
from longctx_cli.config.model_shape import ModelShape, read_model_config
from longctx_cli.config.rope import check_context, check_rope_settings
from longctx_cli.config.rules import (
    _advice,
    _check_adapter,
    check_attention_dropout,
    check_grpo_router_aux_loss,
    check_heads,
    check_prefix_sharing,
    check_query_position_scaling,
    check_router_aux_loss,
    check_sequence_len,
    generation_steps,
    layout_for,
    rollout_decoding_note,
)
from longctx_cli.config.schema import Config
from longctx_cli.config.vision_plan import check_vision, images_attend_both_ways
from longctx_cli.config.vision_plan import plan_rows as vision_plan_rows
from longctx_cli.config.world import Platform, resolve_world
from longctx_cli.layout import Layout, ring_reason

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
                *tp_rules.layout_rows(lay.dp, lay.sp, lay.tp,
                                      self.tokens_per_rank_per_forward),
                ("ring_attn_func", lay.ring_attn_func if lay.ring > 1 else "-"),
                *([("why this ring", self.ring_reason)] if lay.ring > 1 else []),
                ("heads_k_stride", str(lay.heads_k_stride)
                 if lay.ring > 1 and lay.ring_attn_func == "varlen_llama3" else "-"),
                ("sharding", lay.sharding if lay.sp > 1 else "none (sp = 1)"),
                ("attention kernel", f"{lay.kernel} ({lay.kernel_reason})"),
                ("fsdp", _fsdp_text(self)),
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
                ("total", f"[bold]{format_gib(mem.total)}[/]"),
                *([("rollouts", f"{format_gib(mem.rollout_total)}: the full weights gathered "
                                f"once per rollout (+{format_gib(mem.rollout_weights)}); "
                                "trl.ds3_gather_for_generation: false gathers a layer per "
                                "token instead, the data-parallel groups in lockstep")]
                  if mem.rollout_weights else []),
            ]),
        ]


def _fsdp_text(plan: Plan) -> str:
    return plan.fsdp_detail if plan.layout.fsdp else "no"


def _training_rows(config: Config) -> tuple[tuple[str, str], ...]:
    """Optimizer, schedule, precision and cadence as the run will use them."""
    warmup = (f"{config.warmup_ratio:g} of the steps" if config.warmup_ratio is not None
              else f"{config.warmup_steps or 0} steps")
    rows = [
        ("objective", objective_text(config)),
        ("optimizer", f"{config.optimizer}, lr {config.learning_rate:g}, "
                      f"weight decay {config.weight_decay:g}"),
        ("schedule", f"{config.lr_scheduler}, warm-up {warmup}"),
        ("precision", config.dtype + (", tf32 matmuls" if config.tf32 else "")),
    ]
    if config.adapter is not None:
        base = "4-bit" if config.load_in_4bit else "8-bit" if config.load_in_8bit else config.dtype
        extras = [n for n, on in (("DoRA", config.peft_use_dora),
                                   ("rsLoRA", config.peft_use_rslora)) if on]
        rows.append(("adapter", f"{config.adapter}, r {config.lora_r}, {base} base"
                     + (f", {', '.join(extras)}" if extras else "")
                     + (f", from {config.lora_model_dir}" if config.lora_model_dir else "")))
    save = ("never" if config.save_strategy == "no" else "every epoch"
            if config.save_strategy == "epoch" else f"{config.saves_per_epoch} per epoch"
            if config.saves_per_epoch else f"every {config.save_steps:g} steps"
            if config.save_steps else "final model only")
    evals = ("never" if config.eval_strategy == "no" else "every epoch"
             if config.eval_strategy == "epoch" else f"{config.evals_per_epoch} per epoch"
             if config.evals_per_epoch else f"every {config.eval_steps:g} steps"
             if config.eval_steps else "none")
    rows += [("checkpoints", save),
             ("eval loss" + (" + rewards" if config.rl else ""), evals)]
    stops = []
    if config.early_stopping_patience:
        stops.append(f"early stopping after {config.early_stopping_patience} evals without "
                     "improvement")
    if config.loss_watchdog_threshold:
        stops.append(f"loss > {config.loss_watchdog_threshold:g} for "
                     f"{config.loss_watchdog_patience} steps")
    if stops:
        rows.append(("stops", "; ".join(stops)))
    trackers = ["metrics.jsonl"] + (["TensorBoard"] if config.use_tensorboard else []) + (
        [f"wandb ({config.wandb_project})"] if wandb_enabled(config) else [])
    rows.append(("logging", ", ".join(trackers)))
    return tuple(rows)


def objective_text(config: Config) -> str:
    """What the run minimises, and for a preference run where its reference comes from."""
    if config.rl is None:
        return "causal-LM loss (mean over target tokens)"
    if config.rl == "grpo":
        return _grpo_text(config)
    text = _preference_text(config)
    if config.prefix_sharing:
        text += "; each pair's prompt once in the row (prefix_sharing)"
    return text


def _grpo_text(config: Config) -> str:
    trl = config.trl
    text = (f"grpo ({trl.loss_type}, {trl.importance_sampling_level}-level ratios, epsilon "
            f"{trl.epsilon:g}/{trl.epsilon_upper:g}); {trl.num_generations} completions of up "
            f"to {trl.max_completion_length} tokens per prompt, sampled under SP from one "
            f"prefill (temperature {trl.temperature:g}); rewards: "
            f"{', '.join(trl.reward_funcs)}")
    if trl.num_iterations > 1:
        text += (f"; {trl.num_iterations} steps per generation batch (rollout-time "
                 "log-probabilities: one no-grad pass)")
    if trl.beta:
        frozen = config.adapter is None or bool(config.lora_model_dir)
        text += (f"; KL to the reference, beta {trl.beta:g}: " + (
            "a frozen copy of the initial model (one more model in memory), one no-grad "
            "pass per micro-batch" if frozen else "the base model with the adapter off, one "
            "no-grad pass per micro-batch, no copy"))
    text += ("; each prompt once in its group's row (prefix_sharing)" if config.prefix_sharing
             else "; each completion after its own prompt copy (prefix_sharing: false)")
    return text


def _preference_text(config: Config) -> str:
    beta = config.preference_beta
    if config.rl == "orpo":
        return (f"orpo, beta {beta:g}: NLL of the chosen sequences (mean over their targets, "
                "prompt included) minus beta x log-sigmoid of the log odds ratio (mean over "
                "pairs); no reference model")
    if config.rl == "simpo":
        return (f"simpo, beta {beta:g}, gamma {config.simpo_gamma:g} (mean over pairs); "
                "no reference model")
    losses = " + ".join(config.dpo_loss_type or ["sigmoid"])
    reference = ("every pair's log-probabilities under the initial weights, one no-grad SP "
                 "pass over the rows before training (kept in output_dir)"
                 if config.precomputed_reference else "the base model with the adapter off, "
                 "one extra no-grad forward per micro-batch, no copy")
    return f"{config.rl} ({losses}), beta {beta:g} (mean over pairs); reference: {reference}"


def wandb_enabled(config: Config) -> bool:
    """Axolotl's rule: wandb logs when a project is named, unless use_wandb says no."""
    if config.use_wandb is not None:
        return config.use_wandb
    return bool(config.wandb_project)


def fsdp_detail(config: Config, layout: Layout) -> str:
    fc = config.fsdp_config
    parts = ["FSDP2", "full shard" if fc is None or fc.reshard_after_forward
             else "no parameter resharding (ZeRO-2)"]
    if fc is not None and fc.offload_params:
        parts.append("params offloaded to CPU")
    if layout.fsdp and layout.dp_replicate > 1:
        parts.append(f"HSDP: {layout.dp_replicate} replicas")
    return ", ".join(parts)


def check_without_model(
    config: Config, world_size: int, world_source: str = "given",
    platform: Platform | None = None,
) -> Layout:
    """The rules that need no model (cheap: run them first); returns the layout.

    Without a `platform` no machine is asked (the rules it checks do not depend on one).
    """
    layout = layout_for(config, world_size, platform, world_source)
    if config.tensor_parallel_size > 1:
        tp_rules.check_tp_config(config)
    check_sequence_len(config, layout)
    if config.rl == "grpo":
        generation_steps(config, layout.dp)
    check_rope_settings(config.rope_scaling)
    # No micro_batch_size rule: varlen_llama3 takes packed rows, and micro-batch rows are
    # concatenated into one row whose documents never attend across a row boundary.
    _check_adapter(config)
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
    check_without_model(config, world_size, world_source)
    tp_rules.check_tp_model(config, shape)
    check_attention_dropout(shape)
    check_router_aux_loss(shape)
    check_grpo_router_aux_loss(config, shape)
    # A plain dict (no transformers config yet) holds no RoPE settings to check.
    check_context(config.sequence_len, config.rope_scaling, shape.hf_config,
                  shape.max_position_embeddings)
    platform = platform or Platform.detect()
    assumed: list[str] = []
    if assume_gpu and not platform.cuda and config.attention_kernel == "flash":
        # A login node plans a GPU job: plan it for the GPU machine and say so.
        assumed.append(
            "this machine has no CUDA GPU; the plan assumes the run's machines have Ampere or "
            "newer CUDA GPUs with flash-attn 2 and ring-flash-attn installed (docs/gpu.md)."
        )
        platform = Platform(cuda=True, ring_flash_attn=True)
    elif assume_gpu and not platform.cuda and config.attention_kernel in ("cudnn", "fa4"):
        # Kernels for Hopper and newer: plan for one, with the cuDNN torch 2.13 bundles.
        assumed.append(
            "this machine has no CUDA GPU; the plan assumes the run's machines have Hopper "
            "(sm90) CUDA GPUs with torch's bundled cuDNN"
            + (" and flash-attn 4 installed" if config.attention_kernel == "fa4" else "")
            + " (docs/gpu.md).")
        platform = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0),
                            cudnn_version=91800, fa4=config.attention_kernel == "fa4")
    layout = layout_for(config, world_size, platform, world_source, shape)
    if not assumed and not platform.cuda and config.attention_kernel == "auto":
        # The same decision on a GPU machine, without and with flash-attn.
        bare, full = (layout_for(config, world_size, Platform(cuda=True, ring_flash_attn=has),
                                 world_source, shape).kernel for has in (False, True))
        assumed.append(
            "no CUDA here, so `attention_kernel: auto` resolves to torch; on Ampere or newer "
            f"CUDA GPUs it resolves to {bare}"
            + ("" if full == bare else f", or {full} with flash-attn installed")
            + " (same attention)."
        )
    check_heads(layout, shape)  # SP works on the heads TP left on the rank
    check_query_position_scaling(config, shape, layout)
    check_prefix_sharing(config, shape, layout)
    sp = layout.sp
    tiled = tiled_scores_run(layout.kernel, platform.cuda, shape, layout.p2p and layout.ring > 1,
                             images_attend_both_ways(config, shape.hf_config))
    memory, memory_notes = estimate_memory(
        config, shape, world_size, layout, host_is_device=not platform.cuda,
        tiled_scores=tiled,
    )
    tower = check_vision(config, shape.hf_config, layout)
    vision_rows: tuple[tuple[str, str], ...] = ()
    if tower is not None:
        memory = replace(memory, vision_tower=sum(tower.memory(config, layout)))
        vision_rows = tuple(vision_plan_rows(tower, config, layout))

    dp = layout.dp
    row_tokens = config.row_tokens
    sequences = config.micro_batch_size * config.gradient_accumulation_steps * dp
    notes = []
    if "built-in table" in shape.source:
        notes.append(
            "the model's config was not downloaded: its shape comes from longctx's built-in "
            "table of known models."
        )
    notes += _advice(config, shape, layout, nproc_per_node) + memory_notes
    decoding = rollout_decoding_note(config, shape)
    if decoding:
        notes.append(decoding)
    notes += tp_rules.tp_notes(config, nproc_per_node)
    return Plan(
        world_size=world_size,
        world_source=world_source,
        layout=layout,
        dtype=config.dtype,
        adapter=config.adapter,
        sequence_len=config.sequence_len,
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        micro_batch_tokens=row_tokens,
        global_batch_sequences=sequences,
        global_batch_tokens=row_tokens * config.gradient_accumulation_steps * dp,
        tokens_per_rank_per_forward=row_tokens // sp,
        tokens_per_rank_per_step=row_tokens // sp * config.gradient_accumulation_steps,
        model=shape,
        memory=memory,
        notes=tuple(notes),
        host_is_device=not platform.cuda,
        training=_training_rows(config),
        vision=vision_rows,
        fsdp_detail=fsdp_detail(config, layout),
        axolotl=tuple(config.axolotl_notes),
        assumed=tuple(assumed),
        attention_buffers_by_ring=_buffers_by_ring(config, shape, layout),
        ring_reason=ring_reason(config.sequence_parallel_mode, config.tensor_parallel_size,
                                config.ring_attn_func is not None,
                                "heads_k_stride" in config.model_fields_set,
                                config.attention_kernel),
    )


def _buffers_by_ring(
    config: Config, shape: ModelShape, layout: Layout
) -> tuple[tuple[str, int], ...]:
    """What each ring algorithm would hold per rank here (the P2P rings hold the same)."""
    if layout.ring == 1:
        return ()
    local = config.micro_batch_size * config.sequence_len // layout.sp
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

    `assume_gpu` (`validate` on a login node): a flash kernel is planned for a CUDA machine."""
    world, source = resolve_world(config, nproc_per_node, nnodes)
    check_without_model(config, world, source)  # fail fast, before transformers is imported
    shape = read_model_config(config)
    return build_plan(config, world, shape, nproc_per_node=nproc_per_node, world_source=source,
                      assume_gpu=assume_gpu)

"""The rough per-rank memory estimate `validate` prints and the fit search uses.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from longctx_cli.config.schema import Config
from longctx_cli.config.sections.parallel import tp_local_shape
from longctx_cli.config.shape import LINEAR_MODULES, MLP_LINEARS, ModelShape, attention_softcap
from longctx_cli.config.units import DTYPE_BYTES, format_gib
from longctx_cli.constants import FUSED_LOSS_BLOCK_BYTES, LOGIT_TRANSFORM_KEYS
from longctx_cli.families import family
from longctx_cli.kernel_choice import TILE
from longctx_cli.layout import Layout, largest_share

# peft keeps LoRA weights in float32 even on a bf16/fp16 base (autocast_adapter_dtype).
LORA_BYTES = 4

# ---- memory estimate --------------------------------------------------------------------
#
# Calibrated against benchmarks/train_step.py (CPU, fp32, peak resident set per rank over a
# full step with AdamW's moments already allocated) and benchmarks/live_activations.py
# --account (every live storage per phase of a steady step); docs/memory.md has both.
# A step's peak is the largest of three moments, each the static state (weights, optimizer
# moments) plus what that moment holds:
# - the loss: the layers' saved activations (under checkpointing each layer's input) and the
#   logits + loss of the shard; gradients only when the step accumulates over micro-batches
#   (a step's gradients are set to None after its update);
# - a decoder layer's backward: the saved activations, the gradients made so far (all but an
#   untied input embedding's, made after the layers), the layer recomputed in backward (under
#   checkpointing) or its transient buffers, and the SP attention buffers;
# - the optimizer update: weights, gradients, moments and the update's temporaries.

# Saved activations per token of one decoder layer, in elements of the compute dtype:
# 2 RMSNorm in/out pairs (4*hidden: a lean norm keeps its input, a plain one its normalized
# tensor, the next linear the output; the MLP's input is the second norm's output); q
# (projection, after RoPE, attention output) 3*q_dim; k and v (projections, k after RoPE)
# ~3*kv_dim; SwiGLU gate, silu(gate), up and their product 4*intermediate.
# Attention never stores T x T scores (flash / LSE-based kernels), so nothing grows with T^2.
NORM_FACTOR = 4
Q_FACTOR = 3
KV_FACTOR = 3
MLP_FACTOR = 4
# Below float32 a layer also saves float32 copies: each RMSNorm its upcast input, unless the
# norms are lean (`lean_norm`: they keep the input in its own dtype), and each LoRA-adapted
# linear its input cast to the adapter's float32 (peft casts before lora_A). Backward
# temporaries of the norms are not counted: the plain norm's (several full-size float32
# tensors) never were, the lean norm's are one chunk (constants.LEAN_NORM_CHUNK_BYTES).
FP32_NORM_COPIES = 2
# On a GPU the layer's backward adds, beside what it saved: the attention backward's dout
# and dq (the compute dtype) and float32 dq accumulator per query head, its dK/dV expanded to
# the query heads when KV heads are shared, and the residual stream's two gradients.
ATTN_BACKWARD_Q_TENSORS = 2
RESIDUAL_GRAD_TENSORS = 2
# Logits bytes per token per vocab entry: the logits in the compute dtype, their float32 copy
# for cross-entropy (the log-softmax kept for backward), and the float32 gradient in backward.
LOGITS_FP32_COPIES = 2
# The fused loss's hidden-size tensors of the shard: the decoder's last output and its final
# norm's output (both saved for backward) and the gradient the loss accumulates for them.
LOSS_HIDDEN_TENSORS = 3
# Ring buffers: gathered K and V, double-buffered (4 tensors), plus dK and dV partials
# before the reduce-scatter in backward (2 tensors).
RING_KV_TENSORS = 6
# The tiled matmul path (kernel `torch` on CUDA; any softcapped layer, which no flash op
# computes) holds float32 score tiles [heads of one call, TILE, TILE] at a time: scores,
# tanh, probabilities, dP and dS in backward. Flash kernels hold no score tiles.
SCORE_TILE_TENSORS = 5
# P2P ring (batch_*), per rank, all KV heads of the rank's own token count: the K/V block at
# hand and the one in flight (4 tensors) and, in backward, this block's dK/dV (2 tensors),
# the dK/dV accumulator being sent and the one arriving (4 float32 tensors) and the float32
# dq accumulator.
P2P_KV_TENSORS = 6
P2P_ACC_FP32_TENSORS = 4
# torch's AdamW (`adamw`, `adamw_torch`) computes sqrt(exp_avg_sq) / bias correction as two
# new tensors: one parameter at a time on a CPU (the for-loop path, both alive at once), for
# every parameter at once on a GPU (the foreach path, its quotient written in place). The
# fused AdamW makes none; other optimizers' temporaries are not counted.
CPU_ADAMW_TEMPORARIES = 2
GPU_ADAMW_TEMPORARIES = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at peak, by part, so each part can be calibrated on its own.

    `total` is not the plain sum: it is the largest of the step's three moments
    (`moments`), each of which holds only some of the parts.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    attention_buffers: int
    total_params: int
    trainable_params: int
    recompute: int = 0
    score_tiles: int = 0
    # rl: grpo under FSDP2: the weights a rollout gathers at once beyond this rank's shard
    # (trl.ds3_gather_for_generation), alive while it decodes, not during the update.
    rollout_weights: int = 0
    # A vision-language model's tower: its weights and state, and its activations for a
    # row of only image tokens (config/sections/vision.py).
    vision_tower: int = 0
    # A cross-attended tower's (Mllama): the row's image states every rank holds and what the
    # cross-attention layers keep of them, through the loss and the backward; and what that
    # backward adds (config/sections/vision.py `CrossAttendedImages`).
    cross_images: int = 0
    cross_images_backward: int = 0
    # The optimizer update's temporaries (see CPU_ADAMW_TEMPORARIES).
    update_temporaries: int = 0
    # Gradients alive through the loss: all of them when a step accumulates over more than
    # one forward, none otherwise.
    loss_gradients: int = 0
    # Gradients made after the decoder layers' backward (an untied, trained input embedding's).
    late_gradients: int = 0

    @property
    def rollout_total(self) -> int:
        """The rollout's moment: the shards, gradients and optimizer state, the gathered
        weights (the KV cache of one prompt shard on top, not counted)."""
        return self.parameters + self.gradients + self.optimizer + self.rollout_weights

    def moments(self) -> list[tuple[str, int]]:
        """The step's three moments and the bytes each holds (see the notes above)."""
        static = self.parameters + self.optimizer + self.vision_tower
        return [
            ("the loss", static + self.loss_gradients + self.activations + self.logits
             + self.cross_images),
            ("a decoder layer's backward",
             static + self.gradients - self.late_gradients + self.activations + self.recompute
             + self.attention_buffers + self.score_tiles + self.cross_images
             + self.cross_images_backward),
            ("the optimizer update", static + self.gradients + self.update_temporaries),
        ]

    @property
    def peak_moment(self) -> str:
        return max(self.moments(), key=lambda m: m[1])[0]

    @property
    def total(self) -> int:
        return max(bytes_ for _, bytes_ in self.moments())

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer),
            ("activations (saved)", self.activations),
            ("logits + loss", self.logits),
            ("layer recomputed in backward", self.recompute),
            ("SP attention buffers", self.attention_buffers),
            ("attention score tiles", self.score_tiles),
            ("optimizer update temporaries", self.update_temporaries),
            *([("vision tower", self.vision_tower)] if self.vision_tower else []),
            *([("cross-attended images", self.cross_images),
               ("  more in their backward", self.cross_images_backward)]
              if self.cross_images else []),
        ]


def _lora_names(config: Config) -> list[str]:
    targets = config.lora.lora_target_modules
    return list(LINEAR_MODULES) if targets == "all-linear" else (
        [targets] if isinstance(targets, str) else list(targets or [])
    )


def lora_parameter_count(config: Config, shape: ModelShape) -> tuple[int, list[str]]:
    """LoRA weights (A: r x in, B: out x r per adapted linear layer) and unmatched names."""
    names = _lora_names(config)
    shapes = shape.linear_shapes()
    count = sum(config.lora.lora_r * sum(shapes[n]) for n in names if n in shapes)
    return count * shape.num_hidden_layers, [n for n in names if n not in shapes]


def lean_norm(config: Config, shape: ModelShape, tp: int = 1) -> bool:
    """Whether training runs the layers' norms through the lean RMSNorm (`runtime/model.py`
    applies it without TP; `lean_norms` in families.py: the model types where it covers every
    norm of a layer). Remote code may define its own norms: counted as plain ones."""
    return (family(shape.model_type).lean_norms and tp == 1
            and not config.model.trust_remote_code)


def fp32_copy_bytes(config: Config, shape: ModelShape, lean: bool = False) -> int:
    """Bytes per token of the float32 copies one layer saves below float32 (see
    FP32_NORM_COPIES; none of the norms' when `lean`); a tiled MLP's adapted linears save
    theirs one tile at a time."""
    if config.model.dtype == "float32":
        return 0
    elements = 0 if lean else FP32_NORM_COPIES * shape.hidden_size
    if config.lora.adapter is not None:
        shapes = shape.linear_shapes()
        elements += sum(shapes[n][0] for n in _lora_names(config)
                        if n in shapes and not (config.memory.tiled_mlp and n in MLP_LINEARS))
    return 4 * elements


def gpu_backward_bytes(config: Config, shape: ModelShape) -> int:
    """Bytes per token a layer's backward allocates on a GPU beyond its saved tensors."""
    b = DTYPE_BYTES[config.model.dtype]
    shared_kv = shape.num_key_value_heads < shape.num_attention_heads
    dkv = 2 * (shape.q_dim if shared_kv else shape.kv_dim) * b
    return (shape.q_dim * (ATTN_BACKWARD_Q_TENSORS * b + 4) + dkv
            + RESIDUAL_GRAD_TENSORS * shape.hidden_size * b)


def layer_activation_elements(config: Config, shape: ModelShape) -> int:
    """Elements saved per token by one decoder layer (see the factors above).

    A tiled MLP saves only its input, already counted as the second norm's output.
    """
    h = shape.hidden_size
    attention = NORM_FACTOR * h + Q_FACTOR * shape.q_dim + KV_FACTOR * shape.kv_dim
    return attention + (0 if config.memory.tiled_mlp else MLP_FACTOR * shape.intermediate_size)


def _mlp_tile_bytes(config: Config, shape: ModelShape, local_tokens: int) -> int:
    """One MLP tile's intermediates, live while that tile is recomputed in backward."""
    if not config.memory.tiled_mlp:
        return 0
    tiles = config.memory.tiled_mlp_tiles or -(-local_tokens // shape.hidden_size)
    tile_tokens = -(-local_tokens // max(1, min(tiles, local_tokens)))
    return MLP_FACTOR * shape.intermediate_size * tile_tokens * DTYPE_BYTES[config.model.dtype]


def _activation_bytes(
    config: Config, shape: ModelShape, local_tokens: int, on_gpu: bool, lean: bool = False
) -> tuple[int, int]:
    """(bytes saved for backward over the whole step, working set of one layer in backward).

    `on_gpu`: the run computes on a GPU, so offloading frees device memory and the layer's
    backward buffers count. `lean`: the norms are lean (`lean_norm`).
    """
    b = DTYPE_BYTES[config.model.dtype]
    per_token = (layer_activation_elements(config, shape) * b
                 + fp32_copy_bytes(config, shape, lean))
    layer = per_token * local_tokens
    gpu_backward = gpu_backward_bytes(config, shape) * local_tokens if on_gpu else 0
    # Transient in backward beside the saved tensors: one MLP tile, the GPU's buffers.
    transient = _mlp_tile_bytes(config, shape, local_tokens) + gpu_backward
    offloaded = config.memory.activation_offloading and on_gpu
    if config.memory.gradient_checkpointing:
        # Each layer keeps only its input [tokens, hidden] (in host memory when offloaded).
        kept = 0 if offloaded else shape.num_hidden_layers * shape.hidden_size * local_tokens * b
        return kept, layer + transient
    if offloaded:
        return 0, layer + transient  # saved tensors live in host memory; one layer's come back
    return shape.num_hidden_layers * layer, transient


def fused_loss(config: Config, shape: ModelShape) -> bool:
    """Whether the trainer's loss will run fused (`runtime/loss.py:fused_head`: a plain linear
    head, no autocast, no FSDP2 or TP sharding, no logit transform, no adapter on it). A
    preference run (`rl`) never does: its per-token log-probabilities feed per-pair losses
    (`train/preference.py`), so the shard's logits exist at once (a chunk's with
    `chunked_loss`)."""
    if config.objective.rl is not None:
        return False
    targets = config.lora.lora_target_modules
    adapted = [*(targets if isinstance(targets, list) else [targets or ""]),
               *(config.lora.lora_modules_to_save or [])]
    head_adapted = config.lora.adapter is not None and any("lm_head" in m for m in adapted)
    return (config.parallel.tensor_parallel_size == 1 and not config.parallel.fsdp
            and config.model.dtype != "float16" and not head_adapted
            and not any(shape.config_value(k) for k in LOGIT_TRANSFORM_KEYS))


def _logits_bytes(config: Config, shape: ModelShape, local_tokens: int) -> int:
    b = DTYPE_BYTES[config.model.dtype]
    if fused_loss(config, shape):  # one block of logits (+ its float32 copy below fp32)
        block = (config.memory.loss_chunk_size if config.memory.chunked_loss
                 else max(1, FUSED_LOSS_BLOCK_BYTES // (4 * shape.vocab_size)))
        logits = min(local_tokens, block) * shape.vocab_size * (4 + (b if b != 4 else 0))
        head_grad = 4 * shape.vocab_size * shape.hidden_size if config.lora.adapter is None else 0
        return logits + head_grad + LOSS_HIDDEN_TENSORS * local_tokens * shape.hidden_size * b
    memory = config.memory
    tokens = min(local_tokens, memory.loss_chunk_size) if memory.chunked_loss else local_tokens
    return tokens * shape.vocab_size * (b + 4 * LOGITS_FP32_COPIES)


def ring_buffer_bytes(
    ring_attn_func: str,
    shape: ModelShape,
    dtype_bytes: int,
    ring_tokens: int,
    ring: int,
    ulysses: int = 1,
    heads_k_stride: int = 1,
) -> int:
    """Per-rank buffers of one ring of `ring` ranks, each holding `ring_tokens` tokens.

    llama3 holds the gathered sequence (of `heads_k_stride` KV heads); a P2P ring two
    blocks of its own size (all the KV heads it holds) and float32 gradient accumulators.
    """
    if ring == 1:
        return 0
    q_heads, kv = largest_share(shape.num_attention_heads, shape.num_key_value_heads, ulysses)
    d = shape.head_dim
    if ring_attn_func == "varlen_llama3":
        stride = min(heads_k_stride, kv)
        return RING_KV_TENSORS * stride * d * ring_tokens * ring * dtype_bytes
    kv_bytes = P2P_KV_TENSORS * kv * d * ring_tokens * dtype_bytes
    return kv_bytes + (P2P_ACC_FP32_TENSORS * kv + q_heads) * d * ring_tokens * 4


def attention_buffer_bytes(
    config: Config, shape: ModelShape, layout: Layout, local_tokens: int,
    ring_attn_func: str | None = None,
) -> int:
    """SP attention buffers per rank (`ring_attn_func`: had that ring been chosen)."""
    sp, ulysses = layout.sp, layout.ulysses
    if sp == 1:
        return 0
    b = DTYPE_BYTES[config.model.dtype]
    total = 0
    if ulysses > 1:
        # All-to-all outputs: q, k, v in and the attention output back, sized by the rank
        # holding the most heads (an uneven split); KV heads are replicated up to `ulysses`
        # when there are fewer of them. Head chunks: one chunk's q, k, v at a time; the
        # output is whole (its token layout).
        hq, hkv = shape.num_attention_heads, shape.num_key_value_heads
        chunks = layout.head_chunks if layout.kernel != "flash" else 1
        q_most, kv_most = largest_share(hq, hkv, ulysses)
        even = q_most * ulysses == hq
        if even:
            qkv = (hq + 2 * max(hkv, ulysses)) // chunks
        else:  # one chunk's split: its largest rank's heads, for the group's tokens
            q_most, kv_most = largest_share(hq // chunks, max(1, hkv // chunks), ulysses)
            qkv = (q_most + 2 * kv_most) * ulysses
        if chunks == 1 and even and family(shape.model_type).spent_qkv:
            qkv = 0  # written over the layer's spent q, k and v (`Family.spent_qkv`)
        total += local_tokens * shape.head_dim * (qkv + shape.num_attention_heads) * b
    # After the all-to-all a ring rank holds the Ulysses group's tokens for 1/ulysses heads.
    total += ring_buffer_bytes(
        ring_attn_func or layout.ring_attn_func, shape, b, local_tokens * ulysses,
        layout.ring, ulysses, layout.heads_k_stride,
    )
    return total


def _score_tile_bytes(shape: ModelShape, layout: Layout, local_tokens: int) -> int:
    """Live score tiles of the tiled matmul path (see SCORE_TILE_TENSORS)."""
    hq, hkv = shape.num_attention_heads, shape.num_key_value_heads
    sp, ulysses = layout.sp, layout.ulysses
    q_most, kv_most = largest_share(hq, hkv, ulysses)  # the rank holding the most heads
    if layout.mode != "ulysses":  # ring (also at sp 1) and hybrid's ring:
        # one call per head group of heads_k_stride KV heads
        heads = min(layout.heads_k_stride, kv_most) * max(1, hq // hkv)
    else:  # the whole row for the heads this rank holds
        heads = q_most
    rows = min(TILE, local_tokens * ulysses)
    keys = min(TILE, local_tokens * sp)
    return SCORE_TILE_TENSORS * heads * rows * keys * 4


def tiled_scores_run(kernel: str, cuda: bool, shape: ModelShape, p2p_ring: bool = False,
                     images_both_ways: bool = False) -> bool:
    """Does the kernel that runs take the tiled matmul path (whose tiles the estimate adds)?

    `torch` on CUDA always; on CPU, and under `torch_flash`, only for softcapped layers. A P2P
    ring (`batch_*` across more than one rank) runs its blocks on the flash op too, except
    under a sliding window (the rows past a block's keys), so on CUDA under `torch_flash` a
    windowed model's P2P ring takes the tiled path. On CUDA the image tokens that attend both
    ways (`images_both_ways`, Gemma 3 with images) take it in sliding-window layers under
    every kernel (the fused ops' non-causal block has no window).
    """
    capped = attention_softcap(shape) is not None
    return (kernel == "torch" and (cuda or capped)) or (cuda and images_both_ways) or (
        kernel == "torch_flash" and (capped or (cuda and p2p_ring and shape.sliding_window)))


def estimate_memory(
    config: Config,
    shape: ModelShape,
    world_size: int,
    layout: Layout,
    *,
    host_is_device: bool = False,
    tiled_scores: bool = False,
) -> tuple[MemoryEstimate, list[str]]:
    """Per-rank peak bytes by part (see the factors above), and notes about the estimate,
    for the run's `layout` on `world_size` ranks (FSDP2 shards over them).

    `host_is_device`: the run computes in host memory (CPU), so offloading frees nothing.
    `tiled_scores`: attention takes the tiled matmul path (`tiled_scores_run`).
    """
    notes: list[str] = []
    b = DTYPE_BYTES[config.model.dtype]
    full_params = shape.parameter_count()
    full_trainable = (lora_parameter_count(config, shape)[0] if config.lora.adapter is not None
                      else full_params)
    tp, sp = layout.tp, layout.sp
    # `quantize_moe_experts` (never with TP): the experts' fused weights, packed as the base.
    experts = shape.fused_expert_weights if config.lora.quantize_moe_experts else 0
    # TP: weights, projections, attention heads and logits columns are 1/tp per rank.
    shape = tp_local_shape(shape, tp)
    base = shape.parameter_count()
    local_tokens = config.row_tokens // sp
    # The base's weights as stored. bitsandbytes packs the decoder's linear weights into 4
    # or 8 bits and keeps their scales on the modules (attributes, which FSDP2 does not
    # shard); embeddings, norms and lm_head keep the dtype.
    weight_bytes, packed_bytes, replicated = base * b, 0, 0
    if config.lora.load_in_4bit or config.lora.load_in_8bit:
        linear = shape.num_hidden_layers * sum(a * o for a, o in shape.linear_shapes().values())
        packed, scales = quantized_weight_bytes(config)
        packed_bytes, replicated = int(linear * packed), int(linear * scales)
        weight_bytes += packed_bytes - linear * b
    if experts:
        # Packed like a linear layer's weight, with the same scales per block.
        packed, scales = quantized_weight_bytes(config)
        packed_bytes += int(experts * packed)
        replicated += int(experts * scales)
        weight_bytes += int(experts * packed)
        bits = 8 if config.lora.load_in_8bit else 4
        held = format_gib(int(experts * (packed + scales)))
        notes.append(f"quantize_moe_experts: the experts' {experts:,} fused weights are held "
                     f"in {bits} bits ({held} with scales).")
    if config.lora.adapter is not None:
        trainable, unmatched = lora_parameter_count(config, shape)
        if unmatched:
            notes.append(
                f"lora_target_modules {unmatched} are not Llama-style linear names; "
                "they are left out of the estimate."
            )
        param_bytes, train_bytes = weight_bytes + trainable * LORA_BYTES, LORA_BYTES
    elif config.model.dtype == "float16":
        # fp16 full fine-tuning keeps float32 master weights (train/precision.py); autocast
        # holds an fp16 copy of each weight it casts during the forward.
        trainable, param_bytes, train_bytes = base, base * (4 + b), 4
        notes.append("float16: float32 master weights, fp16 autocast copies, loss scaling.")
    else:
        trainable, param_bytes, train_bytes = base, base * b, b
    if config.memory.activation_offloading and host_is_device:
        notes.append("activation_offloading frees nothing on a CPU run: host memory is the "
                     "memory the run computes in.")
    # FSDP2 shards weights, grads and state over the ranks holding the same TP shard (of one
    # replica under HSDP).
    shard = world_size // (tp * layout.dp_replicate) if layout.fsdp else 1
    if layout.fsdp and packed_bytes:
        notes.append(
            f"FSDP-QLoRA: the packed {'4' if config.lora.load_in_4bit else '8'}-bit weights "
            f"({format_gib(packed_bytes)}) are sharded over {shard} ranks, "
            f"{format_gib(packed_bytes // shard)} per rank; their quantization scales "
            f"({format_gib(replicated)}) stay whole on every rank.")
    # FSDP2 all-gathers one layer at a time and prefetches the next: two full layers live
    # (of a quantized base, its packed bytes).
    gathered = 2 * (weight_bytes // max(1, shape.num_hidden_layers)) if layout.fsdp else 0
    optimizer = config.training.optimizer
    moments = 0 if optimizer == "sgd" else 2  # AdamW: exp_avg and exp_avg_sq
    if optimizer.startswith(("lion", "paged_lion")):
        moments = 1
    state_scale = _optimizer_state_scale(config.training.optimizer, train_bytes)
    saved, recompute = _activation_bytes(config, shape, local_tokens, not host_is_device,
                                         lean_norm(config, shape, tp))
    if tp > 1 and config.memory.gradient_checkpointing:
        saved //= tp  # the layer inputs kept are the residual stream: 1/tp of the tokens
    # rl: grpo with a KL term and no adapter to switch off: a frozen copy of the model.
    copies = 2 if config.objective.rl == "grpo" and config.trl.beta and (
        config.lora.adapter is None or config.lora.lora_model_dir) else 1
    gradients = trainable * train_bytes // shard
    # A step's gradients live through a loss only when a step runs more than one forward.
    forwards = config.training.gradient_accumulation_steps * config.training.micro_batch_size
    accumulating = forwards > 1 or config.objective.rl is not None
    # An untied input embedding's gradient is made after every layer's backward.
    late = (shape.vocab_size * shape.hidden_size * train_bytes // shard
            if config.lora.adapter is None and not shape.tie_word_embeddings else 0)
    estimate = MemoryEstimate(
        parameters=copies * (param_bytes // shard + replicated) + gathered,
        gradients=gradients,
        loss_gradients=gradients if accumulating else 0,
        late_gradients=late,
        update_temporaries=update_temporary_bytes(config, shape, trainable, train_bytes,
                                                  host_is_device) // shard,
        optimizer=int(moments * trainable * train_bytes * state_scale) // shard,
        activations=saved,
        logits=_logits_bytes(config, shape, local_tokens),
        attention_buffers=attention_buffer_bytes(config, shape, layout, local_tokens),
        rollout_weights=(weight_bytes - weight_bytes // shard
                         if layout.fsdp and config.objective.rl == "grpo"
                         and config.trl.ds3_gather_for_generation else 0),
        total_params=full_params + (full_trainable if config.lora.adapter is not None else 0),
        trainable_params=full_trainable,
        recompute=recompute,
        score_tiles=(
            _score_tile_bytes(shape, layout, local_tokens) if tiled_scores else 0
        ),
    )
    return estimate, notes


def update_temporary_bytes(config: Config, shape: ModelShape, trainable: int,
                           train_bytes: int, host_is_device: bool) -> int:
    """Bytes torch's AdamW allocates during its update beyond its state (see
    CPU_ADAMW_TEMPORARIES): on a CPU two of the largest trained tensor, on a GPU one of
    every trained weight. 0 for any other optimizer (the fused AdamW makes none)."""
    if config.training.optimizer not in ("adamw", "adamw_torch"):
        return 0
    if not host_is_device:
        return GPU_ADAMW_TEMPORARIES * trainable * train_bytes
    linears = shape.linear_shapes().values()
    if config.lora.adapter is not None:  # an adapter's A or B: r x the wider side
        largest = config.lora.lora_r * max(max(a, o) for a, o in linears)
    else:
        largest = max(shape.vocab_size * shape.hidden_size, *(a * o for a, o in linears))
    return CPU_ADAMW_TEMPORARIES * largest * train_bytes


def quantized_weight_bytes(config: Config) -> tuple[float, float]:
    """Bytes per weight of a bitsandbytes linear layer: (the packed weight, its scales).

    4-bit: two weights a byte and a float32 absmax per block of 64 (bitsandbytes' block
    size), or with double quantization (the default) an 8-bit absmax per block plus a
    float32 scale per 256 of those. 8-bit: a byte and a float32 scale per row (~3% at most)."""
    if not config.lora.load_in_4bit:
        return 1.0, 0.03
    kwargs = config.lora.bnb_config_kwargs or {}
    nested = kwargs.get("bnb_4bit_use_double_quant", True)
    return 0.5, (1 / 64 + 4 / (64 * 256)) if nested else 4 / 64


def _optimizer_state_scale(optimizer: str, train_bytes: int) -> float:
    """Bytes of one optimizer moment relative to one trainable weight's bytes."""
    if optimizer.endswith("4bit"):
        return 0.5 / train_bytes
    if optimizer.endswith("8bit") or optimizer.endswith("fp8"):
        return 1.0 / train_bytes
    if optimizer.endswith("32bit") or optimizer == "paged_adamw":
        return 4.0 / train_bytes
    return 1.0

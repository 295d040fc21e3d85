"""Check a config against the world size and the model, and resolve it into a `Plan`.

The plan is what `longctx validate` prints: how ranks are grouped, how many tokens each rank
sees, which attention kernel runs, and a rough per-rank memory estimate. Every rule that can
fail raises a `UserError` naming the key, its value, why it is wrong and how to fix it.

Nothing here imports `torch.distributed`; torch itself is imported only inside the
functions that ask about CUDA, so `longctx --help` stays fast.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from longctx_cli.config import known_models, tp_rules
from longctx_cli.config.schema import Config
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from rich.table import Table

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# peft keeps LoRA weights in float32 even on a bf16/fp16 base (autocast_adapter_dtype).
LORA_BYTES = 4
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- model shape ------------------------------------------------------------------------


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
    # The transformers config it was read from, for the fidelity probe (None when unknown).
    hf_config: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any, source: str = "model config") -> ModelShape:
        """Read the shape from a transformers `PretrainedConfig` (its text part if multimodal)."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = getattr(text, "num_attention_heads", None)
        hidden = getattr(text, "hidden_size", None)
        if not heads or not hidden:
            raise UserError(
                f"cannot read `num_attention_heads`/`hidden_size` from the {source}.",
                fix="use a decoder-only causal LM (Llama, Qwen2, Mistral, ...).",
            )
        intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
        return cls(
            model_type=str(getattr(text, "model_type", "") or "unknown"),
            hidden_size=int(hidden),
            intermediate_size=int(intermediate or 4 * hidden),
            num_hidden_layers=int(getattr(text, "num_hidden_layers", 1)),
            num_attention_heads=int(heads),
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab_size=int(getattr(text, "vocab_size", 0) or 0),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            source=source,
            hf_config=hf_config,
        )

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


# ---- reading the model config -----------------------------------------------------------


def _build_from_dict(fields: dict[str, Any], key: str) -> Any:
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


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """A cheap TCP probe so an offline machine does not wait through the hub's retries."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy may reach what a direct connection cannot; let the hub client try
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout_s).close()
    except OSError:
        return False
    return True


def _from_table(model_id: str, reason: str) -> ModelShape | None:
    fields = known_models.lookup(model_id)
    if fields is None:
        return None
    hf = _build_from_dict(fields, "base_model")
    return ModelShape.from_hf_config(hf, source=f"{model_id} (built-in table; {reason})")


def read_model_config(config: Config) -> ModelShape:
    """The model's shape: from `model_config`, a local path, the local cache, the hub, or,
    for a few well-known ids when the hub cannot be used, from `known_models`."""
    if config.model_config_dict is not None:
        hf = _build_from_dict(config.model_config_dict, "model_config")
        return ModelShape.from_hf_config(hf, source="inline `model_config`")
    from transformers import AutoConfig

    model_id = str(config.base_model)
    trust = config.trust_remote_code
    local = Path(model_id).expanduser()
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
        hf = AutoConfig.from_pretrained(model_id, trust_remote_code=trust, local_files_only=True)
        return ModelShape.from_hf_config(hf, source=f"{model_id} (local cache)")
    except (OSError, ValueError):
        pass  # not cached: ask the hub below
    if not _hub_reachable():
        shape = _from_table(model_id, "the hub is unreachable")
        if shape is not None:
            return shape
        raise _unreadable(model_id, "the Hugging Face hub is unreachable and it is not cached")
    try:
        hf = AutoConfig.from_pretrained(model_id, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        shape = _from_table(model_id, "the hub refused the download")
        if shape is not None:
            return shape
        raise _unreadable(model_id, str(e).splitlines()[0]) from None
    return ModelShape.from_hf_config(hf, source=f"{model_id} (hub)")


def _unreadable(model_id: str, why: str) -> UserError:
    known = ", ".join(sorted({k for k in known_models.KNOWN_MODELS if "instruct" not in k}))
    return UserError(
        f"cannot read the config of `base_model` = {model_id!r}: {why}.",
        fix="check the id, connect to the hub (or log in for gated models), point `base_model` "
        "at a local folder, or describe the model inline with `model_config`. Ids with a "
        f"built-in shape that work offline: {known}.",
    )


# ---- world size and platform ------------------------------------------------------------


def resolve_world(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> tuple[int, str]:
    """World size and where it came from: flags, else torchrun's WORLD_SIZE, else the config."""
    if nproc_per_node is not None:
        nodes = nnodes or 1
        return nproc_per_node * nodes, f"--nproc-per-node {nproc_per_node} x --nnodes {nodes}"
    if nnodes is not None:
        raise UserError(
            f"--nnodes {nnodes} was given without --nproc-per-node.",
            fix="also pass --nproc-per-node (ranks per node), "
            "e.g. `--nproc-per-node 8 --nnodes 2`.",
        )
    env = os.environ.get("WORLD_SIZE")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UserError(
                f"the environment variable WORLD_SIZE = {env!r} is not a positive integer.",
                fix="unset it or pass --nproc-per-node.",
            )
        return int(env), "WORLD_SIZE from the environment"
    if config.world_size is not None:
        return config.world_size, "`world_size` in the config"
    return 1, "default (no --nproc-per-node, WORLD_SIZE or `world_size`)"


def resolve_world_size(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> int:
    """World size: flags, else torchrun's WORLD_SIZE, else `config.world_size`, else 1."""
    return resolve_world(config, nproc_per_node, nnodes)[0]


@dataclass(frozen=True)
class Platform:
    """What the machine running `validate` offers; tests pass their own."""

    cuda: bool
    ring_flash_attn: bool

    @classmethod
    def detect(cls) -> Platform:
        import torch

        cuda = torch.cuda.is_available()
        # ring_flash_attn imports flash_attn (CUDA only) at import time: try it only on CUDA.
        return cls(cuda=cuda, ring_flash_attn=cuda and _importable("ring_flash_attn"))


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # flash_attn can fail with OSError/RuntimeError on a broken CUDA setup
        return False
    return True


# ---- memory estimate --------------------------------------------------------------------
#
# Calibrated against benchmarks/train_step.py (CPU, fp32, peak resident set per rank over a
# full step with AdamW's moments already allocated); docs/memory.md has the measurements.
# The peak of a step is the static state (weights, gradients, optimizer moments, SP buffers)
# plus what is saved for backward (`activations`) plus the larger of two working sets that
# never coexist: the logits + loss of the shard (computed after the decoder, freed before
# its backward) and, under gradient checkpointing, the one layer recomputed in backward.

# Saved activations per token of one decoder layer, in elements of the compute dtype:
# 2 RMSNorm in/out pairs (4*hidden; the MLP's input is the second norm's output); q
# (projection, after RoPE, attention output) 3*q_dim; k and v (projections, k after RoPE)
# ~3*kv_dim; SwiGLU gate, silu(gate), up and their product 4*intermediate.
# Attention never stores T x T scores (flash / LSE-based kernels), so nothing grows with T^2.
NORM_FACTOR = 4
Q_FACTOR = 3
KV_FACTOR = 3
MLP_FACTOR = 4
# Logits bytes per token per vocab entry: the logits in the compute dtype, their float32 copy
# for cross-entropy (the log-softmax kept for backward), and the float32 gradient in backward.
LOGITS_FP32_COPIES = 2
# Ring buffers: gathered K and V, double-buffered (4 tensors), plus dK and dV partials
# before the reduce-scatter in backward (2 tensors).
RING_KV_TENSORS = 6


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at peak, by part, so each part can be calibrated on its own.

    `total` is not the plain sum: `logits` and `recompute` are working sets of different
    moments of the step, and only the larger of them counts.
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

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer + self.activations
            + self.attention_buffers + max(self.logits, self.recompute)
        )

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer),
            ("activations (saved)", self.activations),
            ("logits + loss", self.logits),
            ("layer recomputed in backward", self.recompute),
            ("SP attention buffers", self.attention_buffers),
        ]


def lora_parameter_count(config: Config, shape: ModelShape) -> tuple[int, list[str]]:
    """LoRA weights (A: r x in, B: out x r per adapted linear layer) and unmatched names."""
    targets = config.lora_target_modules
    names = list(LINEAR_MODULES) if targets == "all-linear" else (
        [targets] if isinstance(targets, str) else list(targets)
    )
    shapes = shape.linear_shapes()
    count = sum(config.lora_r * sum(shapes[n]) for n in names if n in shapes)
    return count * shape.num_hidden_layers, [n for n in names if n not in shapes]


def layer_activation_elements(config: Config, shape: ModelShape) -> int:
    """Elements saved per token by one decoder layer (see the factors above).

    A tiled MLP saves only its input, already counted as the second norm's output.
    """
    h = shape.hidden_size
    attention = NORM_FACTOR * h + Q_FACTOR * shape.q_dim + KV_FACTOR * shape.kv_dim
    return attention + (0 if config.tiled_mlp else MLP_FACTOR * shape.intermediate_size)


def _mlp_tile_bytes(config: Config, shape: ModelShape, local_tokens: int) -> int:
    """One MLP tile's intermediates, live while that tile is recomputed in backward."""
    if not config.tiled_mlp:
        return 0
    tiles = config.tiled_mlp_tiles or -(-local_tokens // shape.hidden_size)
    tile_tokens = -(-local_tokens // max(1, min(tiles, local_tokens)))
    return MLP_FACTOR * shape.intermediate_size * tile_tokens * DTYPE_BYTES[config.dtype]


def _activation_bytes(
    config: Config, shape: ModelShape, local_tokens: int, offload_frees_device: bool
) -> tuple[int, int]:
    """(bytes saved for backward over the whole step, working set of one layer in backward)."""
    b = DTYPE_BYTES[config.dtype]
    layer = layer_activation_elements(config, shape) * local_tokens * b
    tile = _mlp_tile_bytes(config, shape, local_tokens)
    offloaded = config.activation_offloading and offload_frees_device
    if config.gradient_checkpointing:
        # Each layer keeps only its input [tokens, hidden] (in host memory when offloaded).
        kept = 0 if offloaded else shape.num_hidden_layers * shape.hidden_size * local_tokens * b
        return kept, layer + tile
    if offloaded:
        return 0, layer + tile  # saved tensors live in host memory; one layer's come back
    return shape.num_hidden_layers * layer, tile


def _logits_bytes(config: Config, shape: ModelShape, local_tokens: int) -> int:
    tokens = min(local_tokens, config.loss_chunk_size) if config.chunked_loss else local_tokens
    return tokens * shape.vocab_size * (DTYPE_BYTES[config.dtype] + 4 * LOGITS_FP32_COPIES)


def _attention_buffer_bytes(
    config: Config, shape: ModelShape, sp: int, ulysses: int, local_tokens: int
) -> int:
    if sp == 1:
        return 0
    b = DTYPE_BYTES[config.dtype]
    full_tokens = local_tokens * sp
    total = 0
    kv_heads = shape.num_key_value_heads
    if ulysses > 1:
        # All-to-all outputs: q, k, v in and the attention output back; KV heads are
        # replicated up to `ulysses` when there are fewer of them.
        kv_eff = max(kv_heads, ulysses)
        total += local_tokens * shape.head_dim * (2 * shape.num_attention_heads + 2 * kv_eff) * b
        kv_heads = max(1, kv_heads // ulysses)
    if sp // ulysses > 1:
        stride = min(config.heads_k_stride, kv_heads)
        total += RING_KV_TENSORS * stride * shape.head_dim * full_tokens * b
    return total


def estimate_memory(
    config: Config,
    shape: ModelShape,
    world_size: int,
    sp: int,
    ulysses: int,
    *,
    host_is_device: bool = False,
) -> tuple[MemoryEstimate, list[str]]:
    """Per-rank peak bytes by part (see the factors above), and notes about the estimate.

    `host_is_device`: the run computes in host memory (CPU), so offloading frees nothing.
    """
    notes: list[str] = []
    b = DTYPE_BYTES[config.dtype]
    full_params = shape.parameter_count()
    full_trainable = (lora_parameter_count(config, shape)[0] if config.adapter == "lora"
                      else full_params)
    tp = config.tensor_parallel_size
    # TP: weights, projections, attention heads and logits columns are 1/tp per rank.
    shape = tp_rules.tp_local_shape(shape, tp)
    base = shape.parameter_count()
    local_tokens = config.micro_batch_size * config.sequence_len // sp
    if config.adapter == "lora":
        trainable, unmatched = lora_parameter_count(config, shape)
        if unmatched:
            notes.append(
                f"lora_target_modules {unmatched} are not Llama-style linear names; "
                "they are left out of the estimate."
            )
        param_bytes, train_bytes = base * b + trainable * LORA_BYTES, LORA_BYTES
    else:
        trainable, param_bytes, train_bytes = base, base * b, b
    if config.activation_offloading and host_is_device:
        notes.append("activation_offloading frees nothing on a CPU run: host memory is the "
                     "memory the run computes in.")
    # FSDP2 shards weights, grads and state over the ranks holding the same TP shard.
    shard = world_size // tp if config.fsdp else 1
    # FSDP2 all-gathers one layer at a time and prefetches the next: two full layers live.
    gathered = 2 * (base // max(1, shape.num_hidden_layers)) * b if config.fsdp else 0
    moments = 0 if config.optimizer == "sgd" else 2  # AdamW: exp_avg and exp_avg_sq
    saved, recompute = _activation_bytes(config, shape, local_tokens, not host_is_device)
    if tp > 1 and config.gradient_checkpointing:
        saved //= tp  # the layer inputs kept are the residual stream: 1/tp of the tokens
    estimate = MemoryEstimate(
        parameters=param_bytes // shard + gathered,
        gradients=trainable * train_bytes // shard,
        optimizer=moments * trainable * train_bytes // shard,
        activations=saved,
        logits=_logits_bytes(config, shape, local_tokens),
        attention_buffers=_attention_buffer_bytes(config, shape, sp, ulysses, local_tokens),
        total_params=full_params + (full_trainable if config.adapter == "lora" else 0),
        trainable_params=full_trainable,
        recompute=recompute,
    )
    return estimate, notes


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


def _ulysses_size(config: Config, sp: int) -> int:
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


def _check_heads(config: Config, shape: ModelShape, sp: int, ulysses: int) -> None:
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


def _check_sequence_len(config: Config, sp: int) -> None:
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
    """The attention kernel that will run, and why."""
    kernel, zigzag = config.attention_kernel, config.sp_sharding == "zigzag"
    if kernel == "flash":
        if not platform.cuda:
            raise UserError(
                "`attention_kernel` = 'flash' needs a CUDA GPU, and torch sees none here.",
                fix="use `attention_kernel: auto` (picks torch here) or `torch`, or run on a "
                "machine with CUDA.",
            )
        if not platform.ring_flash_attn:
            raise UserError(
                "`attention_kernel` = 'flash' needs the `ring_flash_attn` and `flash_attn` "
                "packages, and they cannot be imported here.",
                fix="`pip install 'longctx[gpu]'`, or use `attention_kernel: torch`.",
            )
        return "flash", "requested"
    if kernel == "torch":
        return "torch", "requested"
    if zigzag:
        return "torch", "auto: zigzag sharding runs on the torch kernel"
    if platform.cuda and platform.ring_flash_attn:
        return "flash", "auto: CUDA and ring_flash_attn available"
    return "torch", "auto: " + ("ring_flash_attn not importable" if platform.cuda else "no CUDA")


def _check_zigzag_kernel(config: Config) -> None:
    if config.attention_kernel == "flash" and config.sp_sharding == "zigzag":
        raise UserError(
            "`sp_sharding` = 'zigzag' is not supported by `attention_kernel: flash` "
            "(ring-flash-attn's llama3 varlen kernel expects contiguous slices).",
            fix="set `sp_sharding: contiguous`, or `attention_kernel: torch` to keep zigzag.",
        )


def _check_adapter(config: Config) -> None:
    if config.adapter != "lora":
        return
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
    if ulysses > shape.num_key_value_heads:
        notes.append(
            f"KV heads ({shape.num_key_value_heads}) are replicated to {ulysses} Ulysses ranks."
        )
    return notes


# ---- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A config resolved against a world size and a model: what a run will do, per rank."""

    world_size: int
    world_source: str
    dp: int
    sp: int
    mode: str
    ulysses: int  # ranks per all-to-all group (1 for ring)
    ring: int  # ranks per ring (1 for ulysses)
    heads_k_stride: int
    sharding: str
    kernel: str  # resolved: "flash" or "torch", never "auto"
    kernel_reason: str
    fsdp: bool
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
    fidelity: str | None = None  # the fidelity probe's verdict, once `validate` has run it
    tp: int = 1  # tensor_parallel_size (TP-sp); the world is dp x sp x tp

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
        for note in self.notes:
            t.add_row("  note", note)
        return t

    def _sections(self, m: ModelShape) -> list[tuple[str, list[tuple[str, str]]]]:
        mem = self.memory
        split = f"{self.ulysses} ulysses x {self.ring} ring"
        return [
            ("model", [
                ("shape", f"{m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
                          f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV heads"),
                ("parameters", f"{_count(mem.total_params)} ({_count(mem.trainable_params)} "
                               f"trainable{', LoRA' if self.adapter else ''}), {self.dtype}"),
                ("shape from", m.source),
                *([("fidelity probe", self.fidelity)] if self.fidelity else []),
            ]),
            ("parallelism", [
                ("world size", f"{self.world_size} ({self.world_source})"),
                ("data parallel", str(self.dp)),
                ("sequence parallel", f"{self.sp} ({self.mode}: {split})"),
                *tp_rules.layout_rows(self.dp, self.sp, self.tp,
                                      self.tokens_per_rank_per_forward),
                ("heads_k_stride", str(self.heads_k_stride) if self.ring > 1 else "-"),
                ("sharding", self.sharding),
                ("attention kernel", f"{self.kernel} ({self.kernel_reason})"),
                ("fsdp", "yes" if self.fsdp else "no"),
            ]),
            ("batch", [
                ("micro batch", f"{self.micro_batch_size} x {self.sequence_len:,} = "
                                f"{self.micro_batch_tokens:,} tokens per SP group"),
                ("global batch", f"{self.global_batch_sequences} sequences = "
                                 f"{self.global_batch_tokens:,} tokens per step"),
                ("tokens per rank", f"{self.tokens_per_rank_per_forward:,} per forward, "
                                    f"{self.tokens_per_rank_per_step:,} per step"),
            ]),
            ("memory per rank (rough)", [
                *[(name, _gib(value)) for name, value in mem.parts()],
                ("total", f"[bold]{_gib(mem.total)}[/]"),
            ]),
        ]


def _gib(n: int) -> str:
    if n < GIB:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def check_without_model(config: Config, world_size: int, world_source: str = "given") -> int:
    """The rules that need neither the model nor the machine (cheap: run them first).

    Returns the Ulysses group size.
    """
    sp = config.sequence_parallel_degree
    if config.tensor_parallel_size > 1:
        tp_rules.check_tp_world(config, world_size, world_source)
        tp_rules.check_tp_config(config)
    else:
        _check_world(sp, world_size, world_source)
    ulysses = _ulysses_size(config, sp)
    _check_sequence_len(config, sp)
    # No micro_batch_size rule: varlen_llama3 takes packed rows, and micro-batch rows are
    # concatenated into one row whose documents never attend across a row boundary.
    _check_zigzag_kernel(config)
    _check_adapter(config)
    return ulysses


def build_plan(
    config: Config,
    world_size: int,
    model_config: ModelShape | Any,
    *,
    platform: Platform | None = None,
    nproc_per_node: int | None = None,
    world_source: str = "given",
) -> Plan:
    """Apply every rule (the first broken one raises UserError) and resolve the plan.

    `model_config` is a `ModelShape` or a transformers `PretrainedConfig`; `platform`
    defaults to what this machine offers.
    """
    shape = (
        model_config if isinstance(model_config, ModelShape)
        else ModelShape.from_hf_config(model_config)
    )
    sp = config.sequence_parallel_degree
    ulysses = check_without_model(config, world_size, world_source)
    tp = config.tensor_parallel_size
    tp_rules.check_tp_model(config, shape)
    # SP works on the heads TP left on the rank.
    _check_heads(config, tp_rules.tp_local_shape(shape, tp), sp, ulysses)
    platform = platform or Platform.detect()
    kernel, reason = _resolve_kernel(config, sp, platform)
    memory, memory_notes = estimate_memory(
        config, shape, world_size, sp, ulysses, host_is_device=not platform.cuda
    )

    dp = world_size // (sp * tp)
    row_tokens = config.micro_batch_size * config.sequence_len
    sequences = config.micro_batch_size * config.gradient_accumulation_steps * dp
    notes = []
    if "built-in table" in shape.source:
        notes.append(
            "the model's config was not downloaded: its shape comes from longctx's built-in "
            "table of known models."
        )
    notes += _advice(config, shape, sp, ulysses, nproc_per_node) + memory_notes
    notes += tp_rules.tp_notes(config, nproc_per_node)
    return Plan(
        world_size=world_size,
        world_source=world_source,
        dp=dp,
        sp=sp,
        mode=config.sequence_parallel_mode,
        ulysses=ulysses,
        ring=sp // ulysses,
        heads_k_stride=config.heads_k_stride,
        sharding=config.sp_sharding if sp > 1 else "none (sp = 1)",
        kernel=kernel,
        kernel_reason=reason,
        fsdp=config.fsdp,
        dtype=config.dtype,
        adapter=config.adapter,
        sequence_len=config.sequence_len,
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        micro_batch_tokens=row_tokens,
        global_batch_sequences=sequences,
        global_batch_tokens=sequences * config.sequence_len,
        tokens_per_rank_per_forward=row_tokens // sp,
        tokens_per_rank_per_step=row_tokens // sp * config.gradient_accumulation_steps,
        tp=tp,
        model=shape,
        memory=memory,
        notes=tuple(notes),
        host_is_device=not platform.cuda,
    )


def plan_for(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> Plan:
    """What `longctx validate` does: resolve the world, read the model, build the plan."""
    world, source = resolve_world(config, nproc_per_node, nnodes)
    check_without_model(config, world, source)  # fail fast, before transformers is imported
    shape = read_model_config(config)
    return build_plan(config, world, shape, nproc_per_node=nproc_per_node, world_source=source)


# ---- smallest sp that fits --------------------------------------------------------------

_SIZE_UNITS = {
    "b": 1, "kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_memory_size(text: str) -> int:
    """Bytes in "80GiB", "80G" (binary), "80GB" (decimal), "512MiB" or a plain byte count."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):] or "b"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise UserError(
            f"--memory-per-rank {text!r} is not a memory size.",
            fix="write a number and a unit, e.g. `80GiB`, `24GB` or `512MiB`.",
        )
    return int(value * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class SpFit:
    """The estimate at one sequence-parallel degree, or why that degree is not legal."""

    sp: int
    total: int | None
    reason: str = ""

    def fits(self, limit: int) -> bool:
        return self.total is not None and self.total <= limit


def _sp_candidates(world_size: int, limit: int = 1024) -> list[int]:
    """Divisors of the world size, then powers of two beyond it (runs that need more ranks)."""
    divisors = {d for d in range(1, world_size + 1) if world_size % d == 0}
    powers = {2**k for k in range(11) if world_size < 2**k <= limit}
    return sorted(divisors | powers)


def _fit_at(
    config: Config, shape: ModelShape, world_size: int, sp: int, host_is_device: bool
) -> SpFit:
    trial = config.model_copy(update={"sequence_parallel_degree": sp})
    world = max(world_size, sp)
    try:
        ulysses = _ulysses_size(trial, sp)
        _check_sequence_len(trial, sp)
        _check_heads(trial, tp_rules.tp_local_shape(shape, trial.tensor_parallel_size), sp,
                     ulysses)
    except UserError as e:
        return SpFit(sp, None, str(e).split(":")[0])
    estimate = estimate_memory(trial, shape, world, sp, ulysses, host_is_device=host_is_device)
    return SpFit(sp, estimate[0].total)


def smallest_fitting_sp(
    config: Config,
    shape: ModelShape,
    world_size: int,
    memory_per_rank: int,
    host_is_device: bool = False,
) -> tuple[SpFit | None, list[SpFit]]:
    """The smallest legal sp whose per-rank estimate fits, and every degree tried up to it.

    Degrees beyond the world size are tried too (they answer "how many ranks would it
    take"); with `fsdp` the weights are then sharded over that many ranks.
    """
    tried = []
    for sp in _sp_candidates(world_size):
        fit = _fit_at(config, shape, world_size, sp, host_is_device)
        tried.append(fit)
        if fit.fits(memory_per_rank):
            return fit, tried
    return None, tried


def fit_report(config: Config, plan: Plan, memory_per_rank: int) -> list[str]:
    """Lines answering `--memory-per-rank`: the smallest sp that fits, and the degrees tried."""
    best, tried = smallest_fitting_sp(
        config, plan.model, plan.world_size, memory_per_rank, plan.host_is_device
    )
    lines = [f"memory per rank {_gib(memory_per_rank)}:"]
    for fit in tried:
        what = _gib(fit.total) if fit.total is not None else f"not legal ({fit.reason})"
        lines.append(f"  sp {fit.sp:>4}: {what}")
    if best is None:
        lines.append(f"no sequence-parallel degree up to {tried[-1].sp} fits; lower sequence_len "
                     "or turn on gradient_checkpointing / chunked_loss / tiled_mlp / fsdp.")
    elif best.sp > plan.world_size:
        lines.append(f"smallest sp that fits: {best.sp} ({_gib(best.total or 0)} per rank), "
                     f"more than the {plan.world_size} ranks of this launch.")
    else:
        lines.append(f"smallest sp that fits: {best.sp} ({_gib(best.total or 0)} per rank)"
                     + ("" if best.sp == plan.sp else f"; the config uses sp {plan.sp}."))
    return lines

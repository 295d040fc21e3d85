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
from longctx_cli.kernel_choice import HALF_DTYPES, TILE, KernelChoice, KernelError, choose_kernel

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
    # The plain dict it was read from without transformers (see `_plain_shape`), if so.
    plain_fields: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def transformers_config(self) -> Any:
        """The transformers config of this model (built from the plain dict on first need:
        validate prints the plan before paying for the import), or None when unknown."""
        if self.hf_config is None and self.plain_fields is not None:
            from transformers import AutoConfig

            fields = dict(self.plain_fields)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return self.hf_config

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
        plain_fields=dict(fields),
    )



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


def _in_hub_cache(model_id: str) -> bool:
    """Whether the local Hugging Face cache holds this id's config.json (no transformers)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id the hub client rejects: let transformers say why
        return True
    return isinstance(found, str)


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
    source = f"{model_id} (built-in table; {reason})"
    shape = _plain_shape(fields, source)
    if shape is not None:
        return shape
    hf = _build_from_dict(fields, "base_model")
    return ModelShape.from_hf_config(hf, source=source)


def read_model_config(config: Config) -> ModelShape:
    """The model's shape: from `model_config`, a local path, the local cache, the hub, or,
    for a few well-known ids when the hub cannot be used, from `known_models`."""
    if config.model_config_dict is not None:
        shape = _plain_shape(config.model_config_dict, "inline `model_config`")
        if shape is not None:
            return shape
        hf = _build_from_dict(config.model_config_dict, "model_config")
        return ModelShape.from_hf_config(hf, source="inline `model_config`")
    model_id = str(config.base_model_config or config.base_model)
    trust = config.trust_remote_code
    local = Path(model_id).expanduser()
    if not local.exists() and not _in_hub_cache(model_id) and not _hub_reachable():
        # Offline and not cached: the built-in table answers without importing transformers.
        shape = _from_table(model_id, "the hub is unreachable")
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
        if not _torch_may_have_gpu():
            return cls(cuda=False, ring_flash_attn=False)
        import torch

        cuda = torch.cuda.is_available()
        # ring_flash_attn imports flash_attn (CUDA only) at import time: try it only on CUDA.
        return cls(cuda=cuda, ring_flash_attn=cuda and _importable("ring_flash_attn"))


def _torch_may_have_gpu() -> bool:
    """False for a CPU-only torch build, read from its version.py without importing torch
    (~1-2 s), so `validate` answers at once on a laptop; True (ask torch) otherwise."""
    import importlib.util
    import sys

    if "torch" in sys.modules:
        return True  # already paid for: let torch answer
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True  # let the import fail the usual way
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return True
    lines = [line.replace(" ", "") for line in text.splitlines()]
    cpu_only = "cuda:Optional[str]=None" in lines or "cuda=None" in lines
    has_rocm_or_xpu = any(
        line.startswith(("hip:", "hip=", "xpu:", "xpu=")) and not line.endswith("=None")
        for line in lines
    )
    return not cpu_only or has_rocm_or_xpu


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
    score_tiles: int = 0

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer + self.activations
            + self.attention_buffers + self.score_tiles + max(self.logits, self.recompute)
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
            ("attention score tiles", self.score_tiles),
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
    kv = max(1, shape.num_key_value_heads // ulysses)
    d = shape.head_dim
    if ring_attn_func == "varlen_llama3":
        stride = min(heads_k_stride, kv)
        return RING_KV_TENSORS * stride * d * ring_tokens * ring * dtype_bytes
    q_heads = shape.num_attention_heads // ulysses
    kv_bytes = P2P_KV_TENSORS * kv * d * ring_tokens * dtype_bytes
    return kv_bytes + (P2P_ACC_FP32_TENSORS * kv + q_heads) * d * ring_tokens * 4


def _attention_buffer_bytes(
    config: Config, shape: ModelShape, sp: int, ulysses: int, local_tokens: int,
    ring_attn_func: str | None = None,
) -> int:
    if sp == 1:
        return 0
    b = DTYPE_BYTES[config.dtype]
    total = 0
    if ulysses > 1:
        # All-to-all outputs: q, k, v in and the attention output back; KV heads are
        # replicated up to `ulysses` when there are fewer of them.
        kv_eff = max(shape.num_key_value_heads, ulysses)
        total += local_tokens * shape.head_dim * (2 * shape.num_attention_heads + 2 * kv_eff) * b
    # After the all-to-all a ring rank holds the Ulysses group's tokens for 1/ulysses heads.
    total += ring_buffer_bytes(
        ring_attn_func or config.ring_attn_func, shape, b, local_tokens * ulysses,
        sp // ulysses, ulysses, config.heads_k_stride,
    )
    return total


def _score_tile_bytes(
    config: Config, shape: ModelShape, sp: int, ulysses: int, local_tokens: int
) -> int:
    """Live score tiles of the tiled matmul path (see SCORE_TILE_TENSORS)."""
    hq, hkv = shape.num_attention_heads, shape.num_key_value_heads
    if config.sequence_parallel_mode != "ulysses":  # ring (also at sp 1) and hybrid's ring:
        # one call per head group of heads_k_stride KV heads
        kv_here = max(1, hkv // ulysses)
        heads = min(config.heads_k_stride, kv_here) * max(1, hq // hkv)
    else:  # the whole row for the heads this rank holds
        heads = max(1, hq // ulysses)
    rows = min(TILE, local_tokens * ulysses)
    keys = min(TILE, local_tokens * sp)
    return SCORE_TILE_TENSORS * heads * rows * keys * 4


def tiled_scores_run(kernel: str, cuda: bool, shape: ModelShape, p2p_ring: bool = False) -> bool:
    """Does the kernel that runs take the tiled matmul path (whose tiles the estimate adds)?

    `torch` on CUDA always; on CPU, and under `torch_flash`, only for softcapped layers. A P2P
    ring (`batch_*` across more than one rank) computes its blocks with the torch kernel's
    block functions, so on CUDA under `torch_flash` it takes the tiled path too.
    """
    capped = attention_softcap(shape) is not None
    return (kernel == "torch" and (cuda or capped)) or (
        kernel == "torch_flash" and (capped or (cuda and p2p_ring)))


def attention_softcap(shape: ModelShape) -> float | None:
    """The model's attention logit softcap (Gemma 2 style), if its config has one."""
    hf = shape.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    cap = getattr(text, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def estimate_memory(
    config: Config,
    shape: ModelShape,
    world_size: int,
    sp: int,
    ulysses: int,
    *,
    host_is_device: bool = False,
    tiled_scores: bool = False,
) -> tuple[MemoryEstimate, list[str]]:
    """Per-rank peak bytes by part (see the factors above), and notes about the estimate.

    `host_is_device`: the run computes in host memory (CPU), so offloading frees nothing.
    `tiled_scores`: attention takes the tiled matmul path (`tiled_scores_run`).
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
    if config.adapter is not None:
        trainable, unmatched = lora_parameter_count(config, shape)
        if unmatched:
            notes.append(
                f"lora_target_modules {unmatched} are not Llama-style linear names; "
                "they are left out of the estimate."
            )
        param_bytes, train_bytes = base * b + trainable * LORA_BYTES, LORA_BYTES
        if config.load_in_4bit or config.load_in_8bit:
            # bitsandbytes stores the decoder's linear weights in 4 or 8 bits (plus ~3% of
            # block scales); embeddings, norms and lm_head keep the dtype.
            linear = shape.num_hidden_layers * sum(a * o for a, o in shape.linear_shapes().values())
            quant = 0.53 if config.load_in_4bit else 1.03
            param_bytes -= linear * b - int(linear * quant)
    elif config.dtype == "float16":
        # fp16 full fine-tuning keeps float32 master weights (train/precision.py); autocast
        # holds an fp16 copy of each weight it casts during the forward.
        trainable, param_bytes, train_bytes = base, base * (4 + b), 4
        notes.append("float16: float32 master weights, fp16 autocast copies, loss scaling.")
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
    if config.optimizer.startswith("lion") or config.optimizer.startswith("paged_lion"):
        moments = 1
    state_scale = _optimizer_state_scale(config.optimizer, train_bytes)
    saved, recompute = _activation_bytes(config, shape, local_tokens, not host_is_device)
    if tp > 1 and config.gradient_checkpointing:
        saved //= tp  # the layer inputs kept are the residual stream: 1/tp of the tokens
    estimate = MemoryEstimate(
        parameters=param_bytes // shard + gathered,
        gradients=trainable * train_bytes // shard,
        optimizer=int(moments * trainable * train_bytes * state_scale) // shard,
        activations=saved,
        logits=_logits_bytes(config, shape, local_tokens),
        attention_buffers=_attention_buffer_bytes(config, shape, sp, ulysses, local_tokens),
        total_params=full_params + (full_trainable if config.adapter is not None else 0),
        trainable_params=full_trainable,
        recompute=recompute,
        score_tiles=(
            _score_tile_bytes(config, shape, sp, ulysses, local_tokens) if tiled_scores else 0
        ),
    )
    return estimate, notes


def _optimizer_state_scale(optimizer: str, train_bytes: int) -> float:
    """Bytes of one optimizer moment relative to one trainable weight's bytes."""
    if optimizer.endswith("4bit"):
        return 0.5 / train_bytes
    if optimizer.endswith("8bit") or optimizer.endswith("fp8"):
        return 1.0 / train_bytes
    if optimizer.endswith("32bit") or optimizer == "paged_adamw":
        return 4.0 / train_bytes
    return 1.0


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
    kernel: str  # resolved: "flash", "torch_flash" or "torch", never "auto"
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
    training: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    fsdp_detail: str = ""
    axolotl: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # key -> what we did
    assumed: tuple[str, ...] = field(default_factory=tuple)  # what validate assumed
    ring_attn_func: str = "varlen_llama3"
    # Attention buffers per rank had each ring algorithm been chosen (ring > 1 only).
    attention_buffers_by_ring: tuple[tuple[str, int], ...] = ()
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
        mem = self.memory
        split = f"{self.ulysses} ulysses x {self.ring} ring"
        return [
            ("model", [
                ("shape", f"{m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
                          f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV heads"),
                ("parameters", f"{_count(mem.total_params)} ({_count(mem.trainable_params)} "
                               f"trainable{', LoRA' if self.adapter else ''}), {self.dtype}"),
                ("shape from", m.source),
            ]),
            ("parallelism", [
                ("world size", f"{self.world_size} ({self.world_source})"),
                ("data parallel", str(self.dp)),
                ("sequence parallel", f"{self.sp} ({self.mode}: {split})"),
                *tp_rules.layout_rows(self.dp, self.sp, self.tp,
                                      self.tokens_per_rank_per_forward),
                ("ring_attn_func", self.ring_attn_func if self.ring > 1 else "-"),
                ("heads_k_stride", str(self.heads_k_stride)
                 if self.ring > 1 and self.ring_attn_func == "varlen_llama3" else "-"),
                ("sharding", self.sharding),
                ("attention kernel", f"{self.kernel} ({self.kernel_reason})"),
                ("fsdp", _fsdp_text(self)),
            ]),
            ("training", list(self.training)),
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
                *[(f"  with {f} instead", f"SP attention buffers {_gib(v)}")
                  for f, v in self.attention_buffers_by_ring
                  if (f == "varlen_llama3") != (self.ring_attn_func == "varlen_llama3")],
                ("total", f"[bold]{_gib(mem.total)}[/]"),
            ]),
        ]


def _fsdp_text(plan: Plan) -> str:
    return plan.fsdp_detail if plan.fsdp else "no"


def _training_rows(config: Config) -> tuple[tuple[str, str], ...]:
    """Optimizer, schedule, precision and cadence as the run will use them."""
    warmup = (f"{config.warmup_ratio:g} of the steps" if config.warmup_ratio is not None
              else f"{config.warmup_steps or 0} steps")
    rows = [
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
    rows += [("checkpoints", save), ("eval loss", evals)]
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


def wandb_enabled(config: Config) -> bool:
    """Axolotl's rule: wandb logs when a project is named, unless use_wandb says no."""
    if config.use_wandb is not None:
        return config.use_wandb
    return bool(config.wandb_project)


def fsdp_detail(config: Config) -> str:
    fc = config.fsdp_config
    parts = ["FSDP2", "full shard" if fc is None or fc.reshard_after_forward
             else "no parameter resharding (ZeRO-2)"]
    if fc is not None and fc.offload_params:
        parts.append("params offloaded to CPU")
    if hsdp_replicas(config) > 1:
        parts.append(f"HSDP: {hsdp_replicas(config)} replicas")
    return ", ".join(parts)


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
    _check_ring_func(config, sp)
    _check_zigzag_kernel(config)
    _check_adapter(config)
    _check_data_parallel(config, world_size, sp)
    return ulysses


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
    sp = config.sequence_parallel_degree
    ulysses = check_without_model(config, world_size, world_source)
    tp = config.tensor_parallel_size
    tp_rules.check_tp_model(config, shape)
    # SP works on the heads TP left on the rank.
    _check_heads(config, tp_rules.tp_local_shape(shape, tp), sp, ulysses)
    platform = platform or Platform.detect()
    assumed: list[str] = []
    if assume_gpu and not platform.cuda and config.attention_kernel == "flash":
        # A login node plans a GPU job: plan it for the GPU machine and say so.
        assumed.append(
            "this machine has no CUDA GPU; the plan assumes the run's machines have CUDA GPUs "
            "with ring-flash-attn and flash-attn installed (`pip install 'longctx[gpu]'`)."
        )
        platform = Platform(cuda=True, ring_flash_attn=True)
    elif not platform.cuda and config.attention_kernel == "auto":
        assumed.append(
            "no CUDA here, so `attention_kernel: auto` resolves to torch; on CUDA machines "
            "with ring-flash-attn it resolves to flash (same attention)."
        )
    kernel, reason = _resolve_kernel(config, sp, platform)
    p2p_ring = config.ring_attn_func != "varlen_llama3" and sp // ulysses > 1
    tiled = tiled_scores_run(kernel, platform.cuda, shape, p2p_ring)
    if tiled and kernel == "torch_flash":
        reason += (
            f"; softcapped attention (softcap {attention_softcap(shape)}) takes the tiled "
            "matmul path: PyTorch's flash op has no softcap"
            if attention_softcap(shape) is not None else
            f"; the P2P ring `{config.ring_attn_func}` computes its blocks on the tiled matmul "
            "path (not yet on PyTorch's flash op)"
        )
    memory, memory_notes = estimate_memory(
        config, shape, world_size, sp, ulysses, host_is_device=not platform.cuda,
        tiled_scores=tiled,
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
        training=_training_rows(config),
        fsdp_detail=fsdp_detail(config),
        axolotl=tuple(config.axolotl_notes),
        assumed=tuple(assumed),
        ring_attn_func=config.ring_attn_func,
        attention_buffers_by_ring=_buffers_by_ring(config, shape, sp, ulysses),
    )


def _buffers_by_ring(
    config: Config, shape: ModelShape, sp: int, ulysses: int
) -> tuple[tuple[str, int], ...]:
    """What each ring algorithm would hold per rank here (the P2P rings hold the same)."""
    if sp // ulysses == 1:
        return ()
    local = config.micro_batch_size * config.sequence_len // sp
    return tuple(
        (f, _attention_buffer_bytes(config, shape, sp, ulysses, local, f))
        for f in ("varlen_llama3", "batch_*")
    )


def plan_for(
    config: Config, nproc_per_node: int | None = None, nnodes: int | None = None
) -> Plan:
    """What `longctx validate` does: resolve the world, read the model, build the plan."""
    world, source = resolve_world(config, nproc_per_node, nnodes)
    check_without_model(config, world, source)  # fail fast, before transformers is imported
    shape = read_model_config(config)
    return build_plan(config, world, shape, nproc_per_node=nproc_per_node, world_source=source,
                      assume_gpu=True)


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
    config: Config, shape: ModelShape, world_size: int, sp: int, host_is_device: bool,
    tiled_scores: bool = False,
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
    estimate = estimate_memory(
        trial, shape, world, sp, ulysses, host_is_device=host_is_device,
        tiled_scores=tiled_scores,
    )
    return SpFit(sp, estimate[0].total)


def smallest_fitting_sp(
    config: Config,
    shape: ModelShape,
    world_size: int,
    memory_per_rank: int,
    host_is_device: bool = False,
    tiled_scores: bool = False,
) -> tuple[SpFit | None, list[SpFit]]:
    """The smallest legal sp whose per-rank estimate fits, and every degree tried up to it.

    Degrees beyond the world size are tried too (they answer "how many ranks would it
    take"); with `fsdp` the weights are then sharded over that many ranks.
    """
    tried = []
    for sp in _sp_candidates(world_size):
        fit = _fit_at(config, shape, world_size, sp, host_is_device, tiled_scores)
        tried.append(fit)
        if fit.fits(memory_per_rank):
            return fit, tried
    return None, tried


def fit_report(config: Config, plan: Plan, memory_per_rank: int) -> list[str]:
    """Lines answering `--memory-per-rank`: the smallest sp that fits, and the degrees tried."""
    best, tried = smallest_fitting_sp(
        config, plan.model, plan.world_size, memory_per_rank, plan.host_is_device,
        plan.memory.score_tiles > 0,
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

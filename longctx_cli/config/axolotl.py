"""Axolotl's config keys, as one table: what longctx does with each key it does not share.

An Axolotl user's YAML is read as it is. Keys that longctx has under the same name and
meaning are schema fields (see config/sections/); every other Axolotl key is in `AXOLOTL_KEYS`:

- **mapped**: translated onto longctx's own keys (`flash_attention: true` ->
  `attention_kernel: auto`, `bf16: auto` -> `dtype: bfloat16`, ...);
- **ignored**: accepted and listed in the plan, because it changes nothing longctx computes
  (kernel switches, hub upload, dataloader workers, ...);
- **refused**: it would change the math or the task (RL trainers, noise), and
  longctx cannot honour it; refused only when set to something other than off/empty.

`RENAMES` holds names from older Axolotl releases and other trainers, offered as the
"did you mean" of an unknown key before spelling distance. The loader (load.py), the plan
(the "axolotl keys" section) and docs/axolotl.md all read these tables, so they cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["mapped", "ignored", "refused"]


class MappingProblem(ValueError):
    """A value a mapped key cannot take; the loader reports it at the key's line."""


@dataclass(frozen=True)
class Rule:
    """What longctx does with one Axolotl key."""

    kind: Kind
    reason: str
    target: str = ""  # our key(s) it maps onto (for the docs)
    # mapped: value (and the whole mapping) -> our keys and a note for the plan
    apply: Callable[[Any, dict[str, Any]], tuple[dict[str, Any], str]] | None = None
    values: tuple[str, ...] = field(default_factory=tuple)  # documented values, if few


def _off(value: Any) -> bool:
    """The value that leaves a feature off: null, false, 0, '' or an empty collection."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def is_active(value: Any) -> bool:
    """A refused key is refused only when it asks for something."""
    return not _off(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MappingProblem(f"`{key}` = {value!r} must be true or false")
    return value


# ---- mappings ---------------------------------------------------------------------------

_FLASH_NOTE = (
    "flash attention on CUDA: PyTorch's own op, or flash-attn where installed and the ring "
    "allows; else the pure PyTorch kernel (the same attention, exact)"
)


def _flash_attention(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if _bool("flash_attention", value) or value is None:
        return {"attention_kernel": "auto"}, f"attention_kernel: auto ({_FLASH_NOTE})"
    return {}, "no effect: longctx's sequence-parallel attention replaces the model's"


# Attention implementations whose kernel is flash-attn; every other value selects the
# torch kernel, since longctx's SP attention replaces the model's attention either way.
_FLASH_IMPLS = ("flash_attention_2", "flash_attention_3")


def _attn_implementation(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if not isinstance(value, str) or not value:
        raise MappingProblem(
            f"`attn_implementation` = {value!r} must be a name such as flash_attention_2, "
            "sdpa or eager"
        )
    if value in _FLASH_IMPLS or ("/" in value and "flash" in value.lower()):
        return {"attention_kernel": "auto"}, f"attention_kernel: auto ({_FLASH_NOTE})"
    return (
        {"attention_kernel": "torch"},
        f"attention_kernel: torch (`{value}` names the model's own attention, which longctx "
        "replaces by its sequence-parallel attention; the torch kernel computes it exactly)",
    )


def _torch_kernel_switch(key: str) -> Callable[[Any, dict[str, Any]], tuple[dict, str]]:
    def apply(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if _bool(key, value):
            return {"attention_kernel": "torch"}, "attention_kernel: torch"
        return {}, "no effect"

    return apply


def _dtype_switch(key: str, dtype: str) -> Callable[[Any, dict[str, Any]], tuple[dict, str]]:
    def apply(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if value == "auto" and key in ("bf16", "tf32"):
            return {"dtype": dtype}, (
                f"dtype: {dtype} (assumed: the GPU supports bfloat16, as A100/H100 and newer "
                "do; set `dtype: float16` for older GPUs)"
            )
        if _bool(key, value):
            return {"dtype": dtype}, f"dtype: {dtype}"
        # bf16: false (and no fp16) trains in float32, as Axolotl does.
        others = ("bf16", "fp16", "bfloat16", "float16")
        if any(data.get(k) not in (None, False) for k in others if k != key):
            return {}, "no effect (another precision key is on)"
        return {"dtype": "float32"}, "dtype: float32 (no half-precision key is on)"

    return apply


def _model_quantization(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    kwargs = data.get("model_quantization_config_kwargs") or {}
    if value == "Mxfp4Config" and kwargs.get("dequantize", True) is True:
        return {}, ("no change: MXFP4 checkpoints (gpt-oss) are always dequantised to `dtype` "
                    "on load, so the weights train in full precision")
    if value == "Mxfp4Config":
        raise MappingProblem("`model_quantization_config_kwargs: {dequantize: false}` keeps "
                             "MXFP4 weights, which cannot be trained; use `dequantize: true`")
    raise MappingProblem(f"`model_quantization_config` = {value!r}: only Mxfp4Config (gpt-oss, "
                         "dequantised on load) is supported; for 4/8-bit bases use "
                         "`load_in_4bit` / `load_in_8bit`")


def _documents_apart(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if _bool("pretrain_multipack_attn", value) or value is None:
        return {}, "no change: packed documents never attend to each other in longctx"
    raise MappingProblem(
        "`pretrain_multipack_attn: false` lets packed documents attend to each other; longctx "
        "keeps every document apart (positions restart, no cross-document attention)")


def _tokenizer_config(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if not isinstance(value, str):
        raise MappingProblem(f"`tokenizer_config` = {value!r} must be a path or hub id")
    return {"tokenizer": value}, f"tokenizer: {value}"


_CAUSAL_LM_CLASSES = ("AutoModelForCausalLM",)
# What Axolotl's vision-language configs name: longctx picks the class from the model's config.
_IMAGE_TEXT_CLASSES = ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
_CLASSIFICATION_CLASSES = ("AutoModelForSequenceClassification",)


def _model_type(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(value, str) and (value in _CLASSIFICATION_CLASSES
                                   or value.endswith("ForSequenceClassification")):
        if data.get("reward_model") is not True:
            raise MappingProblem(
                f"`model_type` = {value!r} is a sequence-classification class, which longctx "
                "trains only as a reward model: set `reward_model: true`, or use "
                "AutoModelForCausalLM")
        return {}, ("no effect: with `reward_model: true` longctx loads with "
                    "AutoModelForSequenceClassification (one label), which picks the model's "
                    "class")
    if isinstance(value, str) and (value in _IMAGE_TEXT_CLASSES
                                   or value.endswith("ForConditionalGeneration")):
        return {}, ("no effect: longctx loads a vision-language model with "
                    "AutoModelForImageTextToText, which picks the model's class")
    if not isinstance(value, str) or not (
        value in _CAUSAL_LM_CLASSES or value.endswith("ForCausalLM")
    ):
        raise MappingProblem(
            f"`model_type` = {value!r} is not a causal-LM or image-text class; longctx trains "
            "causal LMs (AutoModelForCausalLM or a *ForCausalLM class) and vision-language "
            "models (AutoModelForImageTextToText or a *ForConditionalGeneration class)"
        )
    return {}, "no effect: longctx always loads with AutoModelForCausalLM, which picks " + (
        "the same class" if value != "AutoModelForCausalLM" else "the model's class"
    )


def _num_labels(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if value != 1 or isinstance(value, bool) or data.get("reward_model") is not True:
        raise MappingProblem(
            f"`num_labels` = {value!r}: longctx builds a sequence-classification head only for "
            "a reward model, with one label; set `reward_model: true` and `num_labels: 1`, or "
            "drop it")
    return {}, "no effect: a reward model (`reward_model: true`) always has one label"


def _fsdp_list(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Axolotl's first-generation `fsdp: [full_shard, auto_wrap, offload]`."""
    if isinstance(value, bool):
        return {"fsdp": value}, ""
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise MappingProblem(f"`fsdp` = {value!r} must be true/false or a list such as "
                             "[full_shard, auto_wrap]")
    allowed = {"full_shard", "shard_grad_op", "hybrid_shard", "offload", "auto_wrap"}
    unknown = [x for x in items if x not in allowed]
    if unknown:
        raise MappingProblem(f"`fsdp` has unknown entries {unknown}; allowed: {sorted(allowed)}")
    if not items:
        return {}, "no effect (empty list)"
    config: dict[str, Any] = {}
    if "shard_grad_op" in items:
        config["reshard_after_forward"] = False
    if "offload" in items:
        config["offload_params"] = True
    out: dict[str, Any] = {"fsdp": True}
    if config:
        out["fsdp_config"] = {**config, **(data.get("fsdp_config") or {})}
    return out, "fsdp: true (FSDP2)" + (f", fsdp_config {config}" if config else "")


def _to(key: str, note: str = "") -> Callable[[Any, dict[str, Any]], tuple[dict, str]]:
    def apply(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if value is None:
            return {}, "no effect (null)"
        return {key: value}, f"{key}: {value}" + (f" ({note})" if note else "")

    return apply


def _auto_resume(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if _bool("auto_resume_from_checkpoints", value) and not data.get("resume_from_checkpoint"):
        return {"resume_from_checkpoint": "auto"}, "resume_from_checkpoint: auto"
    return {}, "no effect"


def _batch_size(value: Any, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    mbs = data.get("micro_batch_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not isinstance(mbs, int):
        raise MappingProblem(f"`batch_size` = {value!r} must be an integer")
    if value < mbs or value % mbs:
        raise MappingProblem(
            f"`batch_size` = {value} must be a multiple of micro_batch_size {mbs}"
        )
    return (
        {"gradient_accumulation_steps": value // mbs},
        f"gradient_accumulation_steps: {value // mbs} (batch_size / micro_batch_size, "
        "as Axolotl computes it)",
    )


# ---- the table --------------------------------------------------------------------------

_KERNEL = "a GPU kernel switch; longctx computes the same thing with its own kernels"
_HUB = "uploading to the Hugging Face hub is not part of longctx; push output_dir/final yourself"
_TRACKER = "longctx logs to metrics.jsonl, TensorBoard and Weights & Biases only"
_MEMORY = "a memory/speed setting of Axolotl's trainer that changes no result here"
_DATALOADER = "longctx's data loader reads prepared rows directly; no workers are involved"
_RL = ("process reward models, PPO and other online trainers are not supported; longctx "
       "trains the causal-LM loss, the preference losses of `rl: dpo|ipo|simpo|orpo`, `rl: "
       "grpo` with reward functions and reward models (`reward_model: true`)")
_VLLM_SERVER = ("rollouts are sampled by longctx itself under SP (the prompt prefilled across "
                "the SP group); a vLLM server is not used: drop the `vllm:` section")

AXOLOTL_KEYS: dict[str, Rule] = {
    # ---- model and tokenizer
    "base_model_ignore_patterns": Rule("ignored", "longctx downloads the model as is"),
    "cls_model_config": Rule("ignored", "longctx reads the config with AutoConfig"),
    "model_type": Rule(
        "mapped", "longctx uses AutoModelForCausalLM (AutoModelForSequenceClassification with "
        "`reward_model: true`)", "-", _model_type,
        ("AutoModelForCausalLM", "<X>ForCausalLM", "AutoModelForImageTextToText",
         "<X>ForConditionalGeneration", "AutoModelForSequenceClassification (reward_model)"),
    ),
    "tokenizer_type": Rule(
        "ignored", "longctx loads tokenizers with AutoTokenizer, which picks the class the "
        "tokenizer's files name"
    ),
    "tokenizer_config": Rule("mapped", "the tokenizer to load", "tokenizer", _tokenizer_config),
    "tokenizer_use_fast": Rule("ignored", "AutoTokenizer picks the fast tokenizer when present"),
    "tokenizer_legacy": Rule("ignored", "only affects a few SentencePiece tokenizers' spaces"),
    "tokenizer_save_jinja_files": Rule("ignored", "the tokenizer is saved as transformers does"),
    "eot_tokens": Rule(
        "ignored", "chat-template label masks come from the template's assistant turns; "
        "end-of-turn tokens are not configured separately"
    ),
    "added_tokens_overrides": Rule("refused", "rewriting the vocabulary is not supported"),
    "embeddings_skip_upcast": Rule("ignored", "embeddings keep the model's dtype"),
    "fix_untrained_tokens": Rule("refused", "re-initialising token embeddings is not supported"),
    "model_kwargs": Rule("refused", "extra from_pretrained arguments are not supported"),
    # Axolotl's DeepEP plugin: `expert_parallel_size` is a key of ours (the parallel section).
    **{key: Rule("ignored", "DeepEP's dispatch buffers and backend; longctx has no expert "
                 "all-to-all (`expert_parallel_size` shards the experts by FSDP2)")
       for key in ("expert_parallel_backend", "expert_parallel_num_nvl_bytes",
                   "expert_parallel_num_rdma_bytes", "expert_parallel_fallback_on_unsupported")},
    "expert_parallel_token_capacity": Rule(
        "refused", "it drops the lowest-weight token-to-expert assignments past the cap, so "
        "the model would route differently from its own forward"),
    "diffusion": Rule("refused", "diffusion language-model training is not supported"),
    "use_onebitllms": Rule(
        "refused", "onebitllms' ternary (1.58-bit) layers are not supported; longctx trains "
        "the model's own linear layers"),
    "model_revision": Rule("refused", "pin the revision by downloading it to a local folder"),
    "experimental_skip_move_to_device": Rule("ignored", _MEMORY),
    "low_cpu_mem_usage": Rule("ignored", _MEMORY),
    "device_map": Rule("ignored", "each rank places the whole model on its own device"),
    "max_memory": Rule("ignored", "each rank places the whole model on its own device"),
    "gpu_memory_limit": Rule("mapped", "the memory `validate` judges the plan's fit against",
                             "memory_per_rank", lambda v, _: ({"memory_per_rank": v},
                                                              f"memory_per_rank: {v}")),
    "use_kernels": Rule("ignored", _KERNEL),
    "processor_kwargs": Rule("refused", "set the image processor's options in its own "
                             "preprocessor_config.json"),
    "is_multimodal": Rule("ignored", "a vision-language model is known by its config"),
    "is_falcon_derived_model": Rule("ignored", "longctx reads the model type from its config"),
    "is_llama_derived_model": Rule("ignored", "longctx reads the model type from its config"),
    "is_mistral_derived_model": Rule("ignored", "longctx reads the model type from its config"),
    "is_qwen_derived_model": Rule("ignored", "longctx reads the model type from its config"),
    # ---- precision
    "bf16": Rule("mapped", "weights and compute in bfloat16", "dtype", _dtype_switch(
        "bf16", "bfloat16"), ("true", "false", "auto")),
    "fp16": Rule("mapped", "weights and compute in float16", "dtype",
                 _dtype_switch("fp16", "float16"), ("true", "false")),
    "bfloat16": Rule("mapped", "weights and compute in bfloat16", "dtype",
                     _dtype_switch("bfloat16", "bfloat16"), ("true", "false")),
    "float16": Rule("mapped", "weights and compute in float16", "dtype",
                    _dtype_switch("float16", "float16"), ("true", "false")),
    "float32": Rule("mapped", "weights and compute in float32", "dtype",
                    _dtype_switch("float32", "float32"), ("true", "false")),
    "fp8": Rule("refused", "fp8 training changes the numerics; not supported"),
    "fp8_enable_fsdp_float8_all_gather": Rule("refused", "fp8 training is not supported"),
    "fp32_norms": Rule("ignored", "norms run in the model's own precision handling"),
    "fp32_norm_classes": Rule("ignored", "norms run in the model's own precision handling"),
    # ---- attention
    "flash_attention": Rule(
        "mapped", "Axolotl's older switch for flash-attn", "attention_kernel", _flash_attention,
        ("true", "false"),
    ),
    "attn_implementation": Rule(
        "mapped", "Axolotl's current attention switch", "attention_kernel",
        _attn_implementation,
        ("flash_attention_2", "flash_attention_3", "<hub>/flash-*", "sdpa", "eager", "..."),
    ),
    "sdp_attention": Rule("mapped", "SDPA attention", "attention_kernel",
                          _torch_kernel_switch("sdp_attention")),
    "eager_attention": Rule("mapped", "eager attention", "attention_kernel",
                            _torch_kernel_switch("eager_attention")),
    "flex_attention": Rule("mapped", "flex attention", "attention_kernel",
                           _torch_kernel_switch("flex_attention")),
    "xformers_attention": Rule("mapped", "xformers attention", "attention_kernel",
                               _torch_kernel_switch("xformers_attention")),
    "sage_attention": Rule("mapped", "SageAttention", "attention_kernel",
                           _torch_kernel_switch("sage_attention")),
    "flex_attn_compile_kwargs": Rule("ignored", _KERNEL),
    "flash_attn_cross_entropy": Rule("ignored", _KERNEL),
    "flash_attn_fuse_mlp": Rule("ignored", _KERNEL),
    "flash_attn_rms_norm": Rule("ignored", _KERNEL),
    "flash_optimum": Rule("ignored", _KERNEL),
    "sdpa_varlen": Rule("ignored", _KERNEL),
    "fused_attn_kernel": Rule("ignored", _KERNEL),
    "large_head_attention": Rule("ignored", _KERNEL),
    "flash_attn_d512": Rule("ignored", _KERNEL),
    "gemma4_hybrid_attn_impl": Rule("ignored", _KERNEL),
    "experts_implementation": Rule("ignored", _KERNEL),
    "s2_attention": Rule("refused", "shifted-sparse attention changes the model's attention"),
    "scaling_softmax": Rule("refused", "a modified softmax changes the model's attention"),
    # ---- kernels and plugins
    "plugins": Rule(
        "ignored", "Axolotl plugins (Liger, Cut Cross Entropy, ...) are fused kernels for the "
        "same loss; longctx fuses a plain head's loss itself (no full logits), and bounds "
        "other heads' logits memory with `chunked_loss`"
    ),
    "liger_rope": Rule("ignored", _KERNEL),
    "liger_rms_norm": Rule("ignored", _KERNEL),
    "liger_glu_activation": Rule("ignored", _KERNEL),
    "liger_layer_norm": Rule("ignored", _KERNEL),
    "liger_cross_entropy": Rule("ignored", _KERNEL),
    "liger_rms_norm_gated": Rule("ignored", _KERNEL),
    "use_scattermoe": Rule("ignored", _KERNEL),
    "use_sonicmoe": Rule("ignored", _KERNEL),
    "liger_fused_linear_cross_entropy": Rule("ignored", _KERNEL),
    "cut_cross_entropy": Rule("ignored", _KERNEL),
    "lora_mlp_kernel": Rule("ignored", _KERNEL),
    "lora_qkv_kernel": Rule("ignored", _KERNEL),
    "lora_o_kernel": Rule("ignored", _KERNEL),
    "lora_embedding_kernel": Rule("ignored", _KERNEL),
    "chunked_cross_entropy": Rule("mapped", "cross-entropy in chunks", "chunked_loss",
                                  _to("chunked_loss")),
    "chunked_cross_entropy_num_chunks": Rule(
        "ignored", "longctx chunks by tokens (`loss_chunk_size`), not by a chunk count"
    ),
    "tiled_mlp_num_shards": Rule("mapped", "MLP tiles", "tiled_mlp_tiles", _to("tiled_mlp_tiles")),
    "tiled_mlp_use_original_mlp": Rule("ignored", "longctx tiles the model's own MLP module"),
    "torch_compile": Rule("ignored", "longctx runs eagerly"),
    "torch_compile_backend": Rule("ignored", "longctx runs eagerly"),
    "torch_compile_mode": Rule("ignored", "longctx runs eagerly"),
    "torch_compile_options": Rule("ignored", "longctx runs eagerly"),
    "deepcompile": Rule("ignored", "longctx runs eagerly"),
    # ---- memory
    "selective_checkpointing": Rule("ignored", "gradient_checkpointing recomputes whole layers"),
    "layer_offloading": Rule("ignored", _MEMORY),
    "gc_steps": Rule("ignored", _MEMORY),
    "gc_collect_steps": Rule("ignored", _MEMORY),
    "torch_empty_cache_steps": Rule("ignored", _MEMORY),
    "lora_on_cpu": Rule("ignored", _MEMORY),
    "qlora_sharded_model_loading": Rule("ignored", _MEMORY),
    "cpu_ram_efficient_loading": Rule("ignored", _MEMORY),
    "auto_find_batch_size": Rule("refused", "the batch size is fixed by the config"),
    # ---- distribution
    "fsdp": Rule("mapped", "Axolotl's first-generation FSDP list", "fsdp, fsdp_config",
                 _fsdp_list, ("[full_shard, auto_wrap]", "[shard_grad_op]", "[offload]")),
    "ddp": Rule("ignored", "data parallelism follows from the world size"),
    "ddp_timeout": Rule("mapped", "collective timeout in seconds", "collective_timeout_s",
                        _to("collective_timeout_s")),
    "ddp_bucket_cap_mb": Rule("ignored", "longctx reduces gradients in one flat buffer"),
    "ddp_broadcast_buffers": Rule("ignored", "every rank builds identical buffers"),
    "ddp_find_unused_parameters": Rule("ignored", "longctx does not use DDP's hooks"),
    "local_rank": Rule("ignored", "set by torchrun"),
    "device": Rule("ignored", "set by torchrun (one device per rank)"),
    "use_ray": Rule("refused", "longctx launches with torchrun, not Ray"),
    "ray_run_name": Rule("ignored", "longctx launches with torchrun, not Ray"),
    "ray_num_workers": Rule("ignored", "longctx launches with torchrun, not Ray"),
    "resources_per_worker": Rule("ignored", "longctx launches with torchrun, not Ray"),
    "accelerator_config": Rule("ignored", "longctx does not use accelerate"),
    # ---- optimizer and schedule
    "batch_size": Rule("mapped", "total rows per step per rank", "gradient_accumulation_steps",
                       _batch_size),
    "optim_args": Rule("refused", "extra optimizer arguments are not supported"),
    "optim_target_modules": Rule("refused", "per-module optimizers (GaLore) are not supported"),
    "embedding_lr": Rule("refused", "per-group learning rates are not supported"),
    "embedding_lr_scale": Rule("refused", "per-group learning rates are not supported"),
    "lr_groups": Rule("refused", "per-group learning rates are not supported"),
    "loraplus_lr_ratio": Rule("refused", "LoRA+ learning rates are not supported"),
    "loraplus_lr_embedding": Rule("refused", "LoRA+ learning rates are not supported"),
    "lr_quadratic_warmup": Rule("refused", "quadratic warm-up is not supported"),
    "cosine_constant_lr_ratio": Rule("refused", "this Axolotl-only schedule is not supported"),
    "lr_div_factor": Rule("refused", "the one-cycle schedule is not supported"),
    "neftune_noise_alpha": Rule("refused", "embedding noise changes the training objective"),
    "noisy_embedding_alpha": Rule("refused", "embedding noise changes the training objective"),
    "relora": Rule("refused", "ReLoRA is not supported"),
    "lisa_n_layers": Rule("refused", "LISA layer freezing is not supported"),
    "lisa_step_interval": Rule("refused", "LISA layer freezing is not supported"),
    "lisa_layers_attribute": Rule("refused", "LISA layer freezing is not supported"),
    "use_pose": Rule("refused", "PoSE position skipping changes the position ids"),
    "qat": Rule("refused", "quantization-aware training is not supported"),
    "quantization": Rule("refused", "post-training quantization is not part of longctx"),
    "model_quantization_config": Rule(
        "mapped", "a transformers quantization config for loading", "-", _model_quantization,
        ("Mxfp4Config",)),
    "model_quantization_config_kwargs": Rule(
        "ignored", "read with `model_quantization_config`"),
    "gptq": Rule("refused", "GPTQ bases are not supported; use load_in_4bit (bitsandbytes)"),
    # ---- adapter
    "lora_fan_in_fan_out": Rule("refused", "only for Conv1D models (GPT-2); not supported"),
    "lora_rank_pattern": Rule("refused", "per-module LoRA ranks are not supported"),
    "lora_alpha_pattern": Rule("refused", "per-module LoRA alphas are not supported"),
    "peft_layers_to_transform": Rule("refused", "adapting a subset of layers is not supported"),
    "peft_layers_pattern": Rule("refused", "adapting a subset of layers is not supported"),
    "peft_layer_replication": Rule("refused", "layer replication changes the model"),
    "peft_init_lora_weights": Rule("refused", "LoRA weights start as peft's default"),
    "peft_trainable_token_indices": Rule("refused", "trainable token rows are not supported"),
    "peft": Rule("refused", "LoftQ initialisation is not supported"),
    "peft_ensure_weight_tying": Rule("ignored", "tied weights stay as the model defines them"),
    "peft_autocast_adapter_dtype": Rule("ignored", "peft keeps adapters in float32 (its default)"),
    # ---- checkpoints, evaluation, logging
    "auto_resume_from_checkpoints": Rule("mapped", "resume the newest checkpoint",
                                         "resume_from_checkpoint", _auto_resume),
    "save_safetensors": Rule("ignored", "longctx always writes safetensors"),
    "save_first_step": Rule("ignored", "checkpoints follow save_steps / saves_per_epoch"),
    "save_only_model": Rule("ignored", "checkpoints always hold what resuming needs"),
    "load_best_model_at_end": Rule("refused", "final/ is the last step's model"),
    "metric_for_best_model": Rule("ignored", "eval loss is the only metric during training"),
    "greater_is_better": Rule("ignored", "eval loss is the only metric during training"),
    "eval_batch_size": Rule(
        "ignored", "eval loss is a token-weighted mean over all eval rows, so the batch size "
        "changes memory only"
    ),
    "eval_sample_packing": Rule(
        "ignored", "packed rows keep documents apart (positions restart, no cross-document "
        "attention), so eval loss is the same packed or not"
    ),
    "eval_table_size": Rule("ignored", "longctx does not sample generations during training"),
    "eval_max_new_tokens": Rule("ignored", "longctx does not sample generations during training"),
    "generate_samples": Rule("ignored", "longctx does not sample generations during training"),
    "do_causal_lm_eval": Rule("ignored", "`longctx eval` runs the long-context evaluation"),
    "eval_causal_lm_metrics": Rule("ignored", "`longctx eval` runs the long-context evaluation"),
    "do_bench_eval": Rule("ignored", "`longctx eval` runs the long-context evaluation"),
    "include_tokens_per_second": Rule("ignored", "metrics.jsonl always has tokens_per_sec"),
    "include_tkps": Rule("ignored", "metrics.jsonl always has tokens_per_sec"),
    "profiler_steps": Rule("ignored", "no profiler integration"),
    "debug": Rule("ignored", "`longctx preprocess` prints the data report"),
    "debug_num_examples": Rule("ignored", "`longctx preprocess` prints the data report"),
    "hub_model_id": Rule("ignored", _HUB),
    "hub_strategy": Rule("ignored", _HUB),
    "hub_revision": Rule("ignored", _HUB),
    "hub_private_repo": Rule("ignored", _HUB),
    "push_dataset_to_hub": Rule("ignored", _HUB),
    "hf_use_auth_token": Rule("ignored", "the hub client uses your login or HF_TOKEN"),
    "use_mlflow": Rule("ignored", _TRACKER),
    "mlflow_tracking_uri": Rule("ignored", _TRACKER),
    "mlflow_experiment_name": Rule("ignored", _TRACKER),
    "mlflow_run_name": Rule("ignored", _TRACKER),
    "hf_mlflow_log_artifacts": Rule("ignored", _TRACKER),
    "use_comet": Rule("ignored", _TRACKER),
    "use_swanlab": Rule("ignored", _TRACKER),
    "otel_metrics_host": Rule("ignored", _TRACKER),
    "otel_metrics_port": Rule("ignored", _TRACKER),
    "swanlab_project": Rule("ignored", _TRACKER),
    "swanlab_experiment_name": Rule("ignored", _TRACKER),
    "swanlab_description": Rule("ignored", _TRACKER),
    "swanlab_workspace": Rule("ignored", _TRACKER),
    "swanlab_mode": Rule("ignored", _TRACKER),
    "swanlab_log_model": Rule("ignored", _TRACKER),
    "swanlab_log_completions": Rule("ignored", _TRACKER),
    "swanlab_completion_log_interval": Rule("ignored", _TRACKER),
    "swanlab_completion_max_buffer": Rule("ignored", _TRACKER),
    "swanlab_api_key": Rule("ignored", _TRACKER),
    "swanlab_web_host": Rule("ignored", _TRACKER),
    "swanlab_api_host": Rule("ignored", _TRACKER),
    "swanlab_lark_webhook_url": Rule("ignored", _TRACKER),
    "swanlab_lark_secret": Rule("ignored", _TRACKER),
    "comet_api_key": Rule("ignored", _TRACKER),
    "comet_workspace": Rule("ignored", _TRACKER),
    "comet_project_name": Rule("ignored", _TRACKER),
    "comet_experiment_key": Rule("ignored", _TRACKER),
    "comet_mode": Rule("ignored", _TRACKER),
    "comet_online": Rule("ignored", _TRACKER),
    "comet_experiment_config": Rule("ignored", _TRACKER),
    "use_otel_metrics": Rule("ignored", _TRACKER),
    "use_trackio": Rule("ignored", _TRACKER),
    "trackio_project_name": Rule("ignored", _TRACKER),
    "gradio_title": Rule("ignored", "no inference UI"),
    "gradio_share": Rule("ignored", "no inference UI"),
    "axolotl_config_path": Rule("ignored", "internal to Axolotl"),
    # ---- data-side keys with no longctx counterpart (the dataset formats are data's)
    "dataset_processes": Rule("mapped", "tokenization processes", "num_proc", _to("num_proc")),
    "dataset_num_proc": Rule("mapped", "tokenization processes", "num_proc", _to("num_proc")),
    "test_datasets": Rule("mapped", "held-out datasets", "eval_datasets", _to("eval_datasets")),
    "min_sample_len": Rule(
        "ignored", "shorter samples are kept and packed into full sequence_len rows, so "
        "every row is still as long as configured"
    ),
    "pad_to_sequence_len": Rule(
        "ignored", "packed rows are padded for sharding only; padding is never a target"
    ),
    "group_by_length": Rule("ignored", "rows are packed to sequence_len, so lengths are equal"),
    "sample_packing_group_size": Rule("ignored", "packing is first-fit-decreasing over the set"),
    "sample_packing_bin_size": Rule("ignored", "packing is first-fit-decreasing over the set"),
    "sample_packing_eff_est": Rule("ignored", "packing efficiency is measured, not estimated"),
    "streaming_multipack_buffer_size": Rule(
        "ignored", "a streamed `pretraining_dataset` is packed row by row as it arrives"),
    "pretrain_multipack_attn": Rule(
        "mapped", "keep packed pretraining documents from attending to each other",
        "-", _documents_apart, ("true",)),
    "multipack_real_batches": Rule("ignored", "rows are packed to sequence_len"),
    "batch_flattening": Rule("ignored", "rows are always flattened (varlen attention)"),
    "shuffle_before_merging_datasets": Rule("ignored", "rows are shuffled each epoch from `seed`"),
    "dataset_keep_in_memory": Rule("ignored", _MEMORY),
    "skip_prepare_dataset": Rule("ignored", "`longctx preprocess` caches; train reuses it"),
    "remove_unused_columns": Rule("ignored", "only token columns are kept"),
    "dataloader_pin_memory": Rule("ignored", _DATALOADER),
    "dataloader_num_workers": Rule("ignored", _DATALOADER),
    "dataloader_prefetch_factor": Rule("ignored", _DATALOADER),
    "dataloader_drop_last": Rule("ignored", "a step's last partial window is always dropped"),
    # ---- RL and other trainers (math-changing)
    "vllm": Rule("refused", _VLLM_SERVER),
    "process_reward_model": Rule("refused", _RL),
    "num_labels": Rule("mapped", "a reward model's head has one label", "-", _num_labels, ("1",)),
    "dpo_use_weighting": Rule("refused", "WPO weighting is not supported"),
    "dpo_padding_free": Rule("ignored", "longctx always packs pairs without padding"),
    "rl_adapter_ref_model": Rule(
        "ignored", "with an adapter the reference is always the base with the adapter off"),
    "ebft": Rule("refused", _RL),
    "trainer_cls": Rule("refused", "longctx has one trainer"),
    "use_eaft": Rule("refused", "a modified loss is not supported"),
}

# Axolotl keys that longctx's schema has under the same name and with the same meaning.
SAME: tuple[str, ...] = (
    "base_model", "base_model_config", "trust_remote_code", "special_tokens", "tf32",
    "revision_of_model", "tokens", "resize_token_embeddings_to_32x", "mean_resizing_embeddings",
    "shrink_embeddings",
    "datasets", "dataset_prepared_path", "val_set_size", "sequence_len", "sample_packing",
    "chat_template", "chat_template_jinja", "train_on_inputs", "shuffle_merged_datasets",
    "dataset_exact_deduplication",
    "pretraining_dataset", "streaming", "sample_packing_sequentially", "curriculum_sampling",
    "reinit_weights", "unfrozen_parameters", "merge_lora", "rope_scaling", "rope_theta",
    "rl", "rl_beta", "dpo_beta", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing",
    "simpo_gamma", "cpo_alpha", "precompute_ref_log_probs", "orpo_alpha", "kto_desirable_weight",
    "kto_undesirable_weight", "trl", "reward_model", "center_rewards_coefficient",
    "sequence_parallel_degree", "context_parallel_size", "heads_k_stride", "ring_attn_func",
    "fsdp", "fsdp_version", "fsdp_config", "deepspeed", "dp_shard_size", "dp_replicate_size",
    "tensor_parallel_size", "world_size", "micro_batch_size", "gradient_accumulation_steps",
    "num_epochs", "max_steps", "learning_rate", "lr_scheduler", "lr_scheduler_kwargs",
    "cosine_min_lr_ratio", "warmup_steps", "warmup_ratio", "optimizer", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "activation_offloading", "tiled_mlp",
    "early_stopping_patience", "loss_watchdog_threshold", "loss_watchdog_patience", "seed",
    "strict", "adapter", "load_in_4bit", "load_in_8bit", "bnb_config_kwargs", "lora_model_dir",
    "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
    "lora_target_parameters", "lora_modules_to_save", "peft_use_dora", "peft_use_rslora",
    "eval_steps", "evals_per_epoch",
    "eval_strategy", "output_dir", "save_steps", "saves_per_epoch", "save_strategy",
    "save_total_limit", "logging_steps", "use_tensorboard", "use_wandb", "wandb_project",
    "wandb_entity", "wandb_name", "wandb_run_id", "wandb_mode", "wandb_watch",
    "wandb_log_model", "resume_from_checkpoint",
    "quantize_moe_experts",
    "llama4_linearized_experts",
)

# Names an Axolotl (or HF Trainer / LLaMA-Factory / TRL) user may write that mean one of
# ours; offered as "did you mean" before spelling distance, which misleads on these.
RENAMES: dict[str, str] = {
    "max_packed_sequence_len": "sequence_len",
    "max_seq_length": "sequence_len",
    "max_seq_len": "sequence_len",
    "sequence_length": "sequence_len",
    "seq_len": "sequence_len",
    "cutoff_len": "sequence_len",
    "model_name": "base_model",
    "model_name_or_path": "base_model",
    "model_id": "base_model",
    "tokenizer_name": "tokenizer",
    "tokenizer_name_or_path": "tokenizer",
    "per_device_train_batch_size": "micro_batch_size",
    "train_batch_size": "micro_batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "num_train_epochs": "num_epochs",
    "epochs": "num_epochs",
    "optim": "optimizer",
    "lr": "learning_rate",
    "lr_scheduler_type": "lr_scheduler",
    "scheduler": "lr_scheduler",
    "evaluation_strategy": "eval_strategy",
    "sequence_parallel_size": "sequence_parallel_degree",
    "sp_degree": "sequence_parallel_degree",
    "context_parallel_degree": "context_parallel_size",
    "cp_size": "context_parallel_size",
    "sequence_parallel_mode_": "sequence_parallel_mode",
    "ulysses_sequence_parallel_size": "sequence_parallel_degree (with sequence_parallel_mode: "
    "ulysses)",
    "tp_size": "tensor_parallel_size",
    "deepspeed_config": "deepspeed",
    "fsdp_plugin": "fsdp_config",
    "report_to": "use_wandb / use_tensorboard",
    "gradient_checkpointing_enable": "gradient_checkpointing",
    "lora_rank": "lora_r",
    "lora_target": "lora_target_modules",
    "lora_target_module": "lora_target_modules",
    "load_in_4bits": "load_in_4bit",
    "load_in_8bits": "load_in_8bit",
    "warmup_steps_ratio": "warmup_ratio",
    "torch_dtype": "dtype",
    "precision": "dtype",
}


# ---- DeepSpeed ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeepSpeedMapping:
    """What a DeepSpeed ZeRO config becomes under FSDP2."""

    stage: int
    offload_params: bool
    offload_optimizer: bool
    source: str

    @property
    def fsdp(self) -> bool:
        return self.stage >= 1

    @property
    def reshard_after_forward(self) -> bool:
        return self.stage >= 3

    def note(self) -> str:
        if not self.fsdp:
            return f"ZeRO-0 ({self.source}) -> no sharding"
        shard = ("FSDP2 full shard (reshard_after_forward: true)" if self.stage >= 3 else
                 "FSDP2 without parameter resharding (reshard_after_forward: false)")
        offload = ", offload_params: true" if self.offload_params or self.offload_optimizer else ""
        extra = ("; ZeRO-1 shards only optimizer states, FSDP2 shards gradients and weights "
                 "too (same result, less memory)") if self.stage == 1 else ""
        return f"ZeRO-{self.stage} ({self.source}) -> {shard}{offload}{extra}"


def _offloads(zero: dict[str, Any], key: str) -> bool:
    device = zero.get(key)
    return isinstance(device, dict) and device.get("device") in ("cpu", "nvme")


def map_deepspeed(value: str | dict[str, Any], base_dir: str | None = None) -> DeepSpeedMapping:
    """Read a DeepSpeed config (mapping, JSON path, or one of Axolotl's bundled file names
    such as `deepspeed_configs/zero3_bf16_cpuoffload_all.json`) into its FSDP2 meaning."""
    import json
    import re
    from pathlib import Path

    if isinstance(value, dict):
        data, source = value, "inline mapping"
    else:
        candidates = [Path(value).expanduser()]
        if base_dir is not None:
            candidates.append(Path(base_dir) / value)
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            # Axolotl ships its ZeRO configs in its repository; their names say what they hold.
            name = Path(value).name.lower()
            match = re.match(r"zero(\d)", name)
            if match is None:
                raise MappingProblem(
                    f"`deepspeed` = {value!r}: no such file, and its name does not say the ZeRO "
                    "stage (like Axolotl's zero3_bf16.json)"
                )
            offload = "cpuoffload" in name or "offload" in name
            params = offload and ("all" in name or "params" in name)
            return DeepSpeedMapping(int(match.group(1)), params, offload,
                                    f"{Path(value).name}, read from its name: file not found")
        try:
            data = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise MappingProblem(f"`deepspeed` = {value!r} is not readable JSON: {e}") from None
        source = str(found)
    zero = data.get("zero_optimization") if isinstance(data, dict) else None
    if not isinstance(zero, dict):
        zero = {}
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise MappingProblem(f"`deepspeed` zero_optimization.stage = {stage!r} must be 0-3")
    return DeepSpeedMapping(
        stage, _offloads(zero, "offload_param"), _offloads(zero, "offload_optimizer"), source
    )

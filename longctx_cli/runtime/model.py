"""Build the model a run trains: load or random-init, SP attention, checkpointing, LoRA, FSDP2."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)

from longctx_cli.config import Config
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.sections.parallel import FsdpConfig
from longctx_cli.config.sections.training import unfrozen_pattern
from longctx_cli.config.shape import causal_lm_class, fused_expert_names, is_vision_language
from longctx_cli.errors import UserError
from longctx_cli.families import VISION_MODULE_NAMES
from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.meta_relay import relay_sp_meta
from longctx_cli.parallel.token_mixing import attach_token_mixing
from longctx_cli.runtime.cache_kwargs import cache_kwargs
from longctx_cli.runtime.experts import linearize_experts, refuse_linearized_checkpoint
from longctx_cli.runtime.head import cast_head_to_float32, decoder_of, model_head
from longctx_cli.runtime.memory_savers import apply_lean_rms_norm, apply_tiled_mlp

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config_of(config: Config) -> PretrainedConfig:
    """The Hugging Face config of the model a run trains, `overrides_of_model_config`
    applied: the plan's (`read_model_config`), read anew. Ranks take it from their plan."""
    return read_model_config(config).transformers_config()


def changes_model_config(config: Config) -> bool:
    """The run changes the model's own config (`overrides_of_model_config`, `rope_scaling`,
    `rope_theta`): whatever loads its base weights must load them with the run's config."""
    model = config.model
    return bool(model.overrides_of_model_config) or model.rope_scaling is not None or (
        model.rope_theta is not None)


def is_mxfp4(hf_config: PretrainedConfig) -> bool:
    """The checkpoint stores MXFP4 weights (gpt-oss)."""
    quant = getattr(hf_config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "mxfp4"


def bnb_quantization(config: Config, dtype: torch.dtype):
    """bitsandbytes settings of `load_in_4bit` / `load_in_8bit` (None: full precision)."""
    if not (config.lora.load_in_4bit or config.lora.load_in_8bit):
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise UserError(
            "`load_in_4bit`/`load_in_8bit` (and `adapter: qlora`) need the `bitsandbytes` "
            "package, which is not installed.",
            where="load_in_4bit" if config.lora.load_in_4bit else "load_in_8bit",
            fix="`pip install 'longctx[bnb]'`.",
        ) from None
    kwargs = dict(config.lora.bnb_config_kwargs or {})
    if config.lora.load_in_4bit:
        # Axolotl's QLoRA defaults: NF4 with double quantization, compute in the run's dtype.
        kwargs = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                  "bnb_4bit_compute_dtype": dtype, **kwargs}
        return BitsAndBytesConfig(load_in_4bit=True, **kwargs)
    return BitsAndBytesConfig(load_in_8bit=True, **kwargs)


class RowwiseInt8(nn.Module):
    """The parametrization of an 8-bit fused expert weight: int8 values with one float32
    scale per row of its last axis (bitsandbytes' vectorwise quantization, as the 8-bit
    linear layers keep theirs), dequantized to the model's dtype on access."""

    def __init__(self, row_stats: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        rows = packed.reshape(-1, packed.shape[-1])
        value = bnb_functional.int8_vectorwise_dequant(rows, self.row_stats)
        return value.reshape(packed.shape).to(self.dtype)


def _quantize_int8(module: nn.Module, param_name: str) -> None:
    """Hold `module.<param_name>` in 8 bits (`RowwiseInt8`), rounded from float16 as the
    8-bit linear layers are."""
    import bitsandbytes.functional as bnb_functional
    from torch.nn.utils import parametrize

    weight = getattr(module, param_name)
    rows = weight.detach().reshape(-1, weight.shape[-1]).to(torch.float16)
    packed, row_stats, _ = bnb_functional.int8_vectorwise_quant(rows)
    setattr(module, param_name, nn.Parameter(packed.reshape(weight.shape), requires_grad=False))
    parametrize.register_parametrization(module, param_name,
                                         RowwiseInt8(row_stats, weight.dtype), unsafe=True)


def _quantize_4bit(module: nn.Module, param_name: str, quantization: Any) -> None:
    """Hold `module.<param_name>` in 4 bits as bitsandbytes' `replace_parameter_4bit` does
    (its quantization, its `Bnb4bitParametrization`), without the state-dict hook it adds:
    that hook writes the packed bytes under the weight's plain name and the quantization
    state as extra keys, which torch.distributed.checkpoint (checkpoints, resume, the final
    export) cannot map back to attributes. The bytes keep their own name
    (`parametrizations.<name>.original`); the state is rebuilt on load by the same
    quantization of the same base."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from torch.nn.utils import parametrize

    weight = getattr(module, param_name)
    packed, state = bnb_functional.quantize_4bit(
        weight.data, compress_statistics=quantization.bnb_4bit_use_double_quant,
        quant_type=quantization.bnb_4bit_quant_type)
    setattr(module, param_name, nn.Parameter(packed, requires_grad=False))
    parametrize.register_parametrization(module, param_name, Bnb4bitParametrization(state),
                                         unsafe=True)


def _cache_dequantized(module: nn.Module) -> None:
    """One dequantization of each quantized weight per forward of `module` (its experts read
    the weight once per expert). The closing hook runs even when the forward stops early (a
    non-reentrant checkpoint's recompute does, by design), or the cache would stay on."""
    from torch.nn.utils import parametrize

    caches: list[Any] = []

    def enter(mod: nn.Module, args: Any) -> None:
        caches.append(parametrize.cached())
        caches[-1].__enter__()

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if caches:
            caches.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def quantize_fused_experts(model: nn.Module, quantization: Any) -> int:
    """`quantize_moe_experts`: pack every fused expert weight (`fused_expert_names`) as the
    base is packed, the way Axolotl does. A 4-bit base: bitsandbytes' 4-bit quantization
    with the base's own quant type and double quantization (`_quantize_4bit`); an 8-bit one:
    int8 with a scale per row (`RowwiseInt8`). The weight is then a parametrization that
    dequantizes on access (frozen, like the quantized linear layers). Returns how many."""
    names = fused_expert_names(model)
    modules: dict[str, nn.Module] = {}
    for name in names:
        module_name, _, param_name = name.rpartition(".")
        module = modules.setdefault(module_name, model.get_submodule(module_name))
        if quantization.load_in_8bit:
            _quantize_int8(module, param_name)
        else:
            _quantize_4bit(module, param_name, quantization)
    for module in modules.values():
        _cache_dequantized(module)
    return len(names)


def remove_fused_expert_quantization(model: nn.Module) -> None:
    """Turn every quantized fused expert weight (`quantize_fused_experts`) back into a plain
    parameter holding its dequantized value (merge-lora: what the adapter trained against)."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from torch.nn.utils import parametrize

    for module in list(model.modules()):
        for name, chain in list(getattr(module, "parametrizations", {}).items()):
            if any(isinstance(p, (Bnb4bitParametrization, RowwiseInt8)) for p in chain):
                value = getattr(module, name).detach().clone()  # dequantized
                # leave_parametrized=True cannot set a float value into the packed bytes.
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
                setattr(module, name, nn.Parameter(value, requires_grad=False))


def load_device_map() -> dict[str, object]:
    if torch.cuda.is_available():
        return {"": torch.cuda.current_device()}
    return {"": "cpu"}


def model_class_and_attention(hf_config: PretrainedConfig, attn_implementation: str,
                              images: bool = False) -> tuple[Any, str | dict[str, str]]:
    """The Auto class a model loads with, and its `attn_implementation`: a vision-language
    model's language model runs the SP attention, its tower the model's own (each rank
    encodes whole images, runtime/vision.py). `images`: the run sets `processor_type`."""
    if is_vision_language(hf_config, images):
        return AutoModelForImageTextToText, {"": attn_implementation,
                                             "text_config": attn_implementation,
                                             "vision_config": "sdpa"}
    return causal_lm_class(hf_config), attn_implementation


def reward_model_class(hf_config: PretrainedConfig) -> tuple[Any, PretrainedConfig]:
    """`reward_model: true`: the Auto class of the model (TRL's
    RewardTrainer loads `AutoModelForSequenceClassification` with `num_labels=1`), checked to
    be transformers' generic one (`score` on the decoder's hidden state at the last non-pad
    token, which `objectives/reward_training.py` reproduces), and its config with one label."""
    from transformers import AutoModelForSequenceClassification
    from transformers.modeling_layers import GenericForSequenceClassification

    model_class = AutoModelForSequenceClassification._model_mapping.get(type(hf_config), None)
    if model_class is None or not issubclass(model_class, GenericForSequenceClassification):
        raise UserError(
            f"`reward_model: true`, but model type `{hf_config.model_type}` has "
            + ("no sequence-classification model in transformers" if model_class is None else
               f"a classifier ({model_class.__name__}) other than transformers' generic one, "
               "whose forward longctx does not reproduce under sequence parallelism") + ".",
            where="reward_model", fix="train a reward model of a decoder family whose "
            "sequence classifier is transformers' generic one (Llama, Mistral, Qwen2/3, "
            "Gemma, Phi-3, OLMo, ...).")
    hf_config = copy.deepcopy(hf_config)
    hf_config.num_labels = 1  # the only output is the reward
    return AutoModelForSequenceClassification, hf_config


def embeddings_size(config: Config, tokenizer_length: int, current: int) -> int:
    """The number of embedding rows the model gets (Axolotl's rule): the tokenizer's length
    (rounded up to 32 with `resize_token_embeddings_to_32x`) when the embeddings are smaller,
    or larger and `shrink_embeddings`; else they stay as they are."""
    target = tokenizer_length
    if config.model.resize_token_embeddings_to_32x:
        target = -(-tokenizer_length // 32) * 32
    if current < target or (current > target and config.model.shrink_embeddings):
        return target
    return current


def fit_embeddings(model: PreTrainedModel, config: Config) -> None:
    """Resize the embeddings (and an untied lm_head) to the tokenizer's length with added
    tokens, as Axolotl does: transformers' `resize_token_embeddings`, new rows drawn from
    `seed` (the same on every rank) or their mean with `mean_resizing_embeddings`."""
    if not config.model.may_resize_embeddings or config.model.tokenizer_source is None:
        return
    from longctx_cli.data.tokenizer import load_tokenizer

    current = model.get_input_embeddings().num_embeddings
    target = embeddings_size(config, len(load_tokenizer(config)), current)
    if target == current:
        return
    if config.lora.adapter is not None and target > current:
        names = [_module_name(model, m) for m in (model.get_input_embeddings(),
                                                  model.get_output_embeddings()) if m is not None]
        missing = [n for n in names if n not in (config.lora.lora_modules_to_save or [])]
        if missing:
            raise UserError(
                f"the tokenizer has {target - current} token(s) the model's embeddings lack "
                f"(`tokens` / `special_tokens`), and with `adapter` their rows train only as "
                f"modules peft saves whole; `lora_modules_to_save` lacks {missing}.",
                where="lora_modules_to_save",
                fix=f"set `lora_modules_to_save: {names}` (as Axolotl requires when adding "
                "tokens), or train without `adapter`.")
    weight = model.get_input_embeddings().weight
    devices = [weight.device.index or 0] if weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the same new rows on every rank
        torch.manual_seed(config.training.seed)
        model.resize_token_embeddings(target, mean_resizing=config.model.mean_resizing_embeddings)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    """The last part of `module`'s name in `model` (`embed_tokens`, `lm_head`)."""
    return next(name for name, m in model.named_modules() if m is module).rsplit(".", 1)[-1]


def load_base_model(
    config: Config, attn_implementation: str, quantize: bool = True,
    hf_config: PretrainedConfig | None = None,
) -> PreTrainedModel:
    """Load `base_model`, or build `model_config` with weights drawn from `config.training.seed`;
    quantized by bitsandbytes when `load_in_4bit`/`load_in_8bit` (and `quantize`) say so.
    `hf_config`: the model's config as the plan read it (else read here)."""
    dtype = DTYPES[config.model.dtype]
    hf_config = hf_config if hf_config is not None else model_config_of(config)
    quantization = bnb_quantization(config, dtype) if quantize else None
    auto_class, attn = model_class_and_attention(hf_config, attn_implementation,
                                                 config.trains_images)
    if config.objective.reward_model:
        auto_class, hf_config = reward_model_class(hf_config)
    if config.model.trust_remote_code:
        warnings.warn(
            "trust_remote_code is on: code from the model repository will run.", stacklevel=2
        )
    if config.model.random_init and quantization is not None:
        # bitsandbytes quantizes while loading: write the seeded random init, load it back.
        import tempfile

        from safetensors.torch import save_model

        with tempfile.TemporaryDirectory(prefix="longctx-base-") as tmp:
            # Every rank writes its own copy: save_pretrained would write on rank 0 only.
            full = load_base_model(config, attn_implementation, False, hf_config)
            full.config.save_pretrained(tmp)
            save_model(full, f"{tmp}/model.safetensors", metadata={"format": "pt"})
            del full
            model = auto_class.from_pretrained(
                tmp, attn_implementation=attn, dtype=dtype,
                quantization_config=quantization, device_map=load_device_map(),
            )
    elif config.model.random_init:
        # Same seed on every rank -> identical initial weights without a broadcast.
        torch.manual_seed(config.training.seed)
        model = auto_class.from_config(
            hf_config, attn_implementation=attn, dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
    else:
        # The overridden config replaces the checkpoint's own (same weights).
        overridden = {"config": hf_config} if changes_model_config(config) else {}
        if quantization is not None:
            overridden.update(quantization_config=quantization, device_map=load_device_map())
        elif is_mxfp4(hf_config):
            from transformers import Mxfp4Config

            # gpt-oss ships MXFP4 expert weights: trained in `dtype`, so dequantised on load.
            overridden.update(quantization_config=Mxfp4Config(dequantize=True))
        if config.objective.reward_model:  # the checkpoint's own config, a one-label head
            overridden["config"] = hf_config
        model, loading = auto_class.from_pretrained(
            config.model.base_model,
            attn_implementation=attn,
            dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
            output_loading_info=True,
            **config.model.revision_kwargs(config.model.base_model),
            **overridden,
        )
        refuse_linearized_checkpoint(loading.get("unexpected_keys") or (),
                                     config.model.base_model)
    if quantization is not None and config.lora.quantize_moe_experts and not (
            quantize_fused_experts(model, quantization)):
        raise UserError(
            f"`quantize_moe_experts: true`, but model type `{model.config.model_type}` has no "
            "fused expert weights (3-D parameters named `expert`) to quantize.",
            where="quantize_moe_experts", fix="remove the key: this model's linear layers "
            "are all quantized by `load_in_4bit` already.")
    if model.config._attn_implementation != attn_implementation:
        raise UserError(
            f"model type `{model.config.model_type}` did not accept attn_implementation "
            f"`{attn_implementation}`, so sequence-parallel attention would be bypassed.",
            where="base_model",
            fix="use a model whose attention dispatches through transformers' AttentionInterface "
            "(Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    fit_embeddings(model, config)
    return model


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """Wrap a model with peft without its FutureWarning on every rank: peft reads
    `model.is_gradient_checkpointing`, which transformers 5.24 deprecated (the model's
    checkpointing is longctx's, set before)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield


def apply_lora(model: PreTrainedModel, config: Config) -> nn.Module:
    from peft import LoraConfig, PeftModel, get_peft_model

    if config.lora.lora_model_dir:
        # Continue a saved adapter (Axolotl's lora_model_dir): its own LoRA settings apply.
        try:
            with peft_quietly():
                return PeftModel.from_pretrained(model, config.lora.lora_model_dir,
                                                 is_trainable=True)
        except (OSError, ValueError) as e:
            raise UserError(
                f"the adapter in `lora_model_dir` = {config.lora.lora_model_dir!r} could not be "
                f"loaded: {str(e).splitlines()[0]}",
                where="lora_model_dir",
                fix="point it at a folder with adapter_config.json (e.g. a previous run's "
                "final/), or remove it to start a new adapter.",
            ) from None
    lora = LoraConfig(
        r=config.lora.lora_r,
        lora_alpha=config.lora.lora_alpha,
        lora_dropout=config.lora.lora_dropout,
        # [] where only parameters are adapted (peft's own way to say no modules).
        target_modules=config.lora.lora_target_modules if config.lora.lora_target_modules
        or not config.lora.lora_target_parameters else [],
        target_parameters=config.lora.lora_target_parameters,
        modules_to_save=config.lora.lora_modules_to_save,
        use_dora=config.lora.peft_use_dora,
        use_rslora=config.lora.peft_use_rslora,
        # SEQ_CLS: peft trains a reward model's new `score` head whole beside the adapter.
        task_type="SEQ_CLS" if config.objective.reward_model else "CAUSAL_LM",
        # A frozen tower gets no adapters either (its linear names match the LM's).
        exclude_modules=VISION_MODULES_PATTERN if config.vision.freeze_mm_modules else None,
    )
    try:
        with peft_quietly():
            return get_peft_model(model, lora)
    except ValueError as e:
        raise UserError(
            f"LoRA could not be applied: {e}",
            where="lora_target_modules",
            fix="name modules that exist in the model, e.g. [q_proj, v_proj], or `all-linear`.",
        ) from None


def apply_fsdp(model: nn.Module, mesh, config: Config | None = None) -> None:
    """Shard every decoder layer, the decoder's remaining parameters and lm_head with FSDP2
    (`fsdp_config`: reshard_after_forward, offload_params)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    fc = config.parallel.fsdp_config if config is not None else None
    options: dict = {"reshard_after_forward": reshards_after_forward(fc, root=False)}
    if fc is not None and fc.offload_params and torch.cuda.is_available():
        # On a CPU run the parameters already live in host memory.
        options["offload_policy"] = CPUOffloadPolicy()

    base = unwrap(model)
    keep_4bit_state_on_modules(base)
    decoder = decoder_of(base)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, **options)
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None:  # a reward model (`reward_model: true`): its classifier's `score`
        head = base.score
    if head.weight is embedding.weight:
        # Tied embeddings: one weight, used first by the decoder and last by the loss (which
        # calls lm_head itself, outside any parent's forward). One group of both modules
        # gathers it before whichever runs first and reduces both uses' gradients.
        fully_shard([embedding, head], mesh=mesh, **options)
    else:
        fully_shard(head, mesh=mesh, **options)
    if is_vision_language(base.config, bool(config and config.trains_images)):
        # The rebuilt forward (runtime/vision.py) calls the tower and the projector itself,
        # outside any parent's forward: each is a group of its own, which gathers its weights
        # when called (the tower block by block).
        from longctx_cli.runtime.vision import vision_modules

        for module in vision_modules(base):
            # Its blocks: Qwen-VL's `blocks`, a CLIP/SigLIP tower's `encoder.layers` (under
            # `vision_model` in PaddleOCR-VL's).
            inner = getattr(module, "vision_model", module)
            encoder = getattr(inner, "encoder", None)
            for block in getattr(module, "blocks", None) or getattr(encoder, "layers", []):
                fully_shard(block, mesh=mesh, **options)
            fully_shard(module, mesh=mesh, **options)
    fully_shard(decoder, mesh=mesh, **options)
    root = {**options, "reshard_after_forward": reshards_after_forward(fc, root=True)}
    fully_shard(model, mesh=mesh, **root)


def reshards_after_forward(fsdp_config: FsdpConfig | None, root: bool) -> bool:
    """Whether an FSDP2 module frees its gathered weights after forward: `fsdp_config`'s
    choice, else FSDP2's own default (every module but the root, whose weights backward
    needs first)."""
    return fsdp_config.reshard_after_forward if fsdp_config is not None else not root


@contextlib.contextmanager
def fsdp_weights_gathered(model: nn.Module, fsdp_config: FsdpConfig | None) -> Iterator[None]:
    """Every FSDP2-sharded weight of `model` gathered once, for the duration (rollouts):
    forwards inside issue no FSDP collective, so data-parallel groups may run different
    numbers of them. On exit each module reshards after forward again as `apply_fsdp`
    sharded it with `fsdp_config`. A model without FSDP2 is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()  # the same all-gathers on every rank, in the same order
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(
                reshards_after_forward(fsdp_config, root=module is model), recurse=False)


def keep_4bit_state_on_modules(model: nn.Module) -> int:
    """FSDP-QLoRA: make every bitsandbytes 4-bit layer hold its quantization state itself.

    A 4-bit weight is a `Params4bit` tensor of packed bytes (uint8 by default, shape
    `[n, 1]`) whose `quant_state` (block scales, code, original shape) says how to read
    them. FSDP2 shards it along its first dimension like any tensor, and in forward and
    backward puts a plain gathered tensor in its place, without that attribute;
    `Linear4bit.forward` then takes the state from the module
    (`fix_4bit_weight_quant_state_from_module`). transformers' loader sets the module's
    copy; this checks it (and sets it from the weight where missing), so a layer can never
    run on bytes it cannot read. FSDP2 casts no integer parameter (mixed precision is for
    floating ones only) and gathers a group of mixed dtypes as bytes, so the gathered
    weights are bit for bit the quantized ones. Returns the number of 4-bit layers."""
    import sys

    if "bitsandbytes" not in sys.modules:  # loading a quantized model imports it
        return 0
    from bitsandbytes.nn import Linear4bit

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            state = getattr(module, "quant_state", None)
        if state is None:
            raise RuntimeError(f"4-bit layer {name} has no quantization state to shard with")
        module.quant_state = state
        count += 1
    return count


def keep_4bit_kernel_of_training(model: nn.Module) -> None:
    """4-bit layers compute with the kernel training uses in every pass. On a CPU with
    AVX512-BF16, bitsandbytes repacks a 4-bit weight for another kernel at its first no-grad
    eval-mode forward (a rollout, an eval), rewriting `weight.data` in place: under FSDP2 that
    is a temporary gathered view whose repacked bytes no longer match the shards (a crash),
    and without FSDP the rollouts would sample from other roundings than the update scores."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def keep_float32_master_weights(model: nn.Module) -> None:
    """float16 training: trainable weights become float32 master weights (autocast computes
    in fp16, `train/precision.py`). Done before TP and FSDP2 shard the parameters: both keep
    their own views of each parameter's storage, which a later dtype change would bypass."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# Module names inside a VLM's tower or projector (peft's `exclude_modules` regex).
VISION_MODULES_PATTERN = rf".*\b({'|'.join(VISION_MODULE_NAMES)})\b.*"


def freeze_vision_modules(model: nn.Module) -> None:
    """`freeze_mm_modules`: the vision tower and its projector keep their weights."""
    from longctx_cli.runtime.vision import vision_modules

    modules = vision_modules(unwrap(model))
    if not modules:
        raise UserError(
            "`freeze_mm_modules: true`, but this model has no vision tower.",
            where="freeze_mm_modules", fix="remove `freeze_mm_modules` for a text model.")
    for module in modules:
        module.requires_grad_(False)


def freeze_all_but(model: nn.Module, patterns: list[str]) -> None:
    """Train only the parameters `patterns` match (Axolotl's `unfrozen_parameters`, see
    `unfrozen_pattern`), and of a pattern with rows only those rows; a list that matches
    nothing is a mistake, not a frozen run."""
    parsed = [unfrozen_pattern(p) for p in patterns]
    # With an adapter, what peft made trainable is the adapter (and `lora_modules_to_save`).
    adapter = ({n for n, p in model.named_parameters() if p.requires_grad}
               if hasattr(model, "peft_config") else None)
    trained = 0
    base = []  # base weights an adapter's pattern would train
    for name, param in model.named_parameters():
        found = [rows for regex, rows in parsed if regex.match(name)]
        if found and adapter is not None and name not in adapter:
            base.append(name)
            continue
        param.requires_grad_(bool(found))
        trained += bool(found)
        if found and None not in found:  # only some rows: zero the others' gradient
            keep = torch.zeros(param.shape[0], dtype=torch.bool)
            for first, last in found:
                keep[first:last] = True
            frozen = (~keep).nonzero().flatten()
            param.register_hook(lambda grad, rows=frozen: grad.index_fill(
                0, rows.to(grad.device), 0.0))
    if base:
        raise UserError(
            f"`unfrozen_parameters` {patterns} with `adapter` matches base weights of the "
            f"model ({', '.join(base[:3])}{', ...' if len(base) > 3 else ''}), which the "
            "adapter's export (adapter_model.safetensors) does not hold: what they learnt "
            "would be lost.",
            where="unfrozen_parameters",
            fix="train whole modules beside the adapter with `lora_modules_to_save` (e.g. "
            "[lm_head, embed_tokens]), and keep `unfrozen_parameters` to adapter names.")
    if not trained:
        names = [n for n, _ in model.named_parameters()]
        raise UserError(
            f"`unfrozen_parameters` {patterns} matches none of the model's parameters, so "
            "nothing would train.",
            where="unfrozen_parameters",
            fix=f"write patterns for names such as {names[0]!r} or {names[-1]!r} (each is "
            "matched from the start of the name).",
        )


def build_model(config: Config, state: ParallelState | None = None,
                hf_config: PretrainedConfig | None = None) -> nn.Module:
    """The model a run trains, with SP attention registered and every option applied
    (`hf_config`: the model's config as the plan read it, else read here).

    With `state`'s TP group the model is sharded with TP-sp before FSDP2, which then shards
    over `state.fsdp_mesh` (the ranks holding the same TP shard, or the world).
    """
    state = state or ParallelState()
    register_sp_attention()
    model = load_base_model(config, ATTN_IMPLEMENTATION, hf_config=hf_config)
    if config.model.llama4_linearized_experts:  # before LoRA: it may target the new linears
        linearize_experts(model, bnb_quantization(config, DTYPES[config.model.dtype]))
    if config.lora.load_in_4bit:
        keep_4bit_kernel_of_training(model)
    mixers = attach_token_mixing(model)  # hybrid models: scans and convolutions per document
    relay_sp_meta(model)  # layers that call their attention without the forward's kwargs
    if mixers and config.objective.prefix_sharing:
        raise UserError(
            f"`prefix_sharing: true`, but this model mixes tokens with {mixers[0].name} (a scan "
            "or convolution, not attention), whose state at the end of the prompt would have to "
            "start both answers; longctx does not carry it over.",
            where="prefix_sharing", fix="set `prefix_sharing: false` for this model.")
    if config.memory.gradient_checkpointing:
        enable_checkpointing(model, {"use_reentrant": False,
                                     **(config.memory.gradient_checkpointing_kwargs or {})})
    if config.lora.adapter is not None:
        model = apply_lora(model, config)
    if config.training.unfrozen_parameters is not None:
        freeze_all_but(model, config.training.unfrozen_parameters)
    if config.vision.freeze_mm_modules:  # last: no `unfrozen_parameters` pattern thaws the tower
        freeze_vision_modules(model)
    if config.memory.tiled_mlp:
        apply_tiled_mlp(model, config.memory.tiled_mlp_tiles)
    if state.layout.tp == 1:
        # Same forward bits, exact gradients, no float32 copies saved or full-size float32
        # temporaries in backward (memory_savers.py). After LoRA: peft's modules_to_save copies
        # are norms too. Not under TP: its norms run on DTensor weights (untested here).
        apply_lean_rms_norm(model)
    if config.model.dtype == "float16":
        keep_float32_master_weights(model)
    if config.objective.rl == "grpo" and config.trl.cast_lm_head_to_fp32:
        cast_head_to_float32(unwrap(model))  # like the master weights: before TP and FSDP2
    if state.layout.tp > 1:
        from longctx_cli.parallel.tensor_parallel import apply_tensor_parallel

        base = unwrap(model)
        rows = base.get_input_embeddings().num_embeddings
        if rows % state.layout.tp:  # the plan checked the vocabulary before tokens were added
            raise UserError(
                f"with the added tokens the embeddings have {rows} rows, which "
                f"`tensor_parallel_size` = {state.layout.tp} does not divide (TP splits the "
                "vocabulary evenly).", where="tokens",
                fix="set `resize_token_embeddings_to_32x: true` (a multiple of 32), or add "
                "tokens up to a multiple of the TP size.")
        try:
            apply_tensor_parallel(decoder_of(base), base.get_output_embeddings(), state,
                                  base.config)
        except ValueError as e:
            raise UserError(str(e), where="tensor_parallel_size",
                            fix="use `tensor_parallel_size: 1` for this model.") from None
    if config.parallel.fsdp and state.fsdp_mesh is not None:
        apply_fsdp(model, state.fsdp_mesh, config)
    model.train()
    return model


def enable_checkpointing(model: PreTrainedModel, kwargs: dict[str, Any]) -> None:
    """Recompute each layer in backward: transformers' activation checkpointing (named
    `gradient_checkpointing_enable` before 5.24, which now warns on every call)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def decoder_and_head(model: nn.Module, images: bool = False) -> tuple[nn.Module, nn.Module]:
    """The decoder stack (returns hidden states) and the head of a (peft-wrapped) model;
    `images`: the run sets `processor_type` (see `is_vision_language`).

    The head is `lm_head` plus the family's logit transform (`runtime/head.py`): every loss
    and score computed from hidden states goes through it, so none skips the transform.
    """
    base = unwrap(model)
    head = model_head(base.get_output_embeddings(), base.config)
    if is_vision_language(base.config, images):
        from longctx_cli.runtime.vision import VisionLanguageForward

        return VisionLanguageForward(base), head
    return decoder_of(base), head


def sp_hidden_states(decoder: nn.Module, batch, where: str = "base_model",
                     cache: Any = None) -> torch.Tensor:
    """Hidden states `[local_tokens, hidden]` of this rank's slice of a sharded row.

    Fails loudly when no layer went through the SP attention (or a covered token mixer):
    each rank would then attend only to its own slice, silently. `where` names what the user
    should change.
    `cache` (a transformers `Cache`) keeps this rank's keys and values for decoding.
    A vision-language model's decoder is its rebuilt forward (runtime/vision.py).
    """
    from longctx_cli.runtime.vision import VisionLanguageForward

    if isinstance(decoder, VisionLanguageForward):
        return decoder.hidden_states(batch, cache)
    hidden = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta,
        **cache_kwargs(decoder, cache),
    ).last_hidden_state
    if not batch.sp_meta.went_through_sp:
        raise UserError(
            "the model's attention layers did not call the sequence-parallel attention, so "
            "each rank would attend only to its own slice of the sequence.",
            where=where,
            fix="use a model whose attention dispatches through transformers' "
            "AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    return hidden.reshape(-1, hidden.shape[-1])

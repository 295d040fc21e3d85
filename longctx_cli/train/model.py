"""Build the model a run trains: load or random-init, SP attention, checkpointing, LoRA, FSDP2."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.parallel.attention import ATTN_IMPLEMENTATION, register_sp_attention
from longctx_cli.train.head import model_head
from longctx_cli.train.memory import apply_tiled_mlp

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config_of(config: Config) -> PretrainedConfig:
    """The Hugging Face config of the model a run trains."""
    if config.model_config_dict is not None:
        fields = dict(config.model_config_dict)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoConfig.from_pretrained(
        config.base_model, trust_remote_code=config.trust_remote_code
    )


def load_base_model(config: Config, attn_implementation: str) -> PreTrainedModel:
    """Load `base_model`, or build `model_config` with weights drawn from `config.seed`."""
    dtype = DTYPES[config.dtype]
    if config.trust_remote_code:
        warnings.warn(
            "trust_remote_code is on: code from the model repository will run.", stacklevel=2
        )
    if config.model_config_dict is not None:
        # Same seed on every rank -> identical initial weights without a broadcast.
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(
            model_config_of(config), attn_implementation=attn_implementation, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            config.base_model,
            attn_implementation=attn_implementation,
            dtype=dtype,
            trust_remote_code=config.trust_remote_code,
        )
    if model.config._attn_implementation != attn_implementation:
        raise UserError(
            f"model type `{model.config.model_type}` did not accept attn_implementation "
            f"`{attn_implementation}`, so sequence-parallel attention would be bypassed.",
            where="base_model",
            fix="use a model whose attention dispatches through transformers' AttentionInterface "
            "(Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    return model


def apply_lora(model: PreTrainedModel, config: Config) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise UserError(
            f"LoRA could not be applied: {e}",
            where="lora_target_modules",
            fix="name modules that exist in the model, e.g. [q_proj, v_proj], or `all-linear`.",
        ) from None


def apply_fsdp(model: nn.Module, mesh) -> None:
    """Shard every decoder layer, the decoder's remaining parameters and lm_head with FSDP2."""
    from torch.distributed.fsdp import fully_shard

    base = unwrap(model)
    if base.config.tie_word_embeddings:
        raise UserError(
            "FSDP with tied input/output embeddings is not supported.",
            where="fsdp",
            fix="set `fsdp: false`, or use a model with `tie_word_embeddings: false`.",
        )
    decoder = base.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh)
    fully_shard(base.get_output_embeddings(), mesh=mesh)
    fully_shard(model, mesh=mesh)


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def build_model(config: Config, fsdp_mesh=None, tp=None) -> nn.Module:
    """The model a run trains, with SP attention registered and every option applied.

    `tp` (a `parallel.tensor_parallel.TPContext`) shards it with TP-sp before FSDP2, which
    then shards over `fsdp_mesh` (the ranks holding the same TP shard).
    """
    register_sp_attention()
    model = load_base_model(config, ATTN_IMPLEMENTATION)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if config.adapter == "lora":
        model = apply_lora(model, config)
    if config.tiled_mlp:
        apply_tiled_mlp(model, config.tiled_mlp_tiles)
    if tp is not None:
        from longctx_cli.parallel.tensor_parallel import apply_tensor_parallel

        base = unwrap(model)
        try:
            apply_tensor_parallel(base.get_decoder(), base.get_output_embeddings(), tp,
                                  base.config)
        except ValueError as e:
            raise UserError(str(e), where="tensor_parallel_size",
                            fix="use `tensor_parallel_size: 1` for this model.") from None
    if config.fsdp and fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh)
    model.train()
    return model


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack (returns hidden states) and the head of a (peft-wrapped) model.

    The head is `lm_head` plus the family's logit transform (`train/head.py`): every loss
    and score computed from hidden states goes through it, so none skips the transform.
    """
    base = unwrap(model)
    return base.get_decoder(), model_head(base.get_output_embeddings(), base.config)


def sp_hidden_states(decoder: nn.Module, batch, where: str = "base_model") -> torch.Tensor:
    """Hidden states `[local_tokens, hidden]` of this rank's slice of a sharded row.

    Fails loudly when no attention layer went through the SP attention: each rank would
    then attend only to its own slice, silently. `where` names what the user should change.
    """
    hidden = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta
    ).last_hidden_state
    if batch.sp_meta.attention_calls == 0:
        raise UserError(
            "the model's attention layers did not call the sequence-parallel attention, so "
            "each rank would attend only to its own slice of the sequence.",
            where=where,
            fix="use a model whose attention dispatches through transformers' "
            "AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    return hidden.reshape(-1, hidden.shape[-1])

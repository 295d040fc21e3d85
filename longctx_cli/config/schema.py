"""The YAML schema: every key a user can write, with its type, default and meaning.

This module is the single source of truth for the config. `docs/config.md` is generated
from it (`python -m longctx_cli.config.docs`), and key names follow Axolotl's where the idea
is the same.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from longctx_cli.kernel_choice import KernelRequest
from longctx_cli.layout import LayoutError, Mode, RingAttnFunc, Sharding, default_ring


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation accepts any of `kinds` (looking inside unions)."""
    if annotation in kinds:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits(a, kinds) for a in typing.get_args(annotation))
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field; `sequence_parallel_degree: true` is a
        # mistake (Axolotl's boolean switches look alike), never a number.
        if isinstance(value, bool) and info.field_name:
            annotation = cls.model_fields[info.field_name].annotation
            if _admits(annotation, (int, float)) and not _admits(annotation, (bool,)):
                raise ValueError("a number is needed, not true/false")
        return value


DatasetType = Literal[
    "completion", "chat_template", "pretrain", "passkey", "input_output",
    "alpaca", "alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca_chat", "alpaca_instruct",
    "alpaca_instruct.load_no_prompt", "alpaca_w_system", "alpaca_w_system.load_instruct",
    "alpaca_w_system.load_chat",
    # preference pairs (with `rl:`), see data/preference.py
    "preference", "chat_template.default", "chat_template.argilla", "chatml.intel",
    "chatml.icr", "chatml.prompt_pairs", "chatml.argilla", "chatml.ultra", "chatml.argilla_chat",
    "llama3.intel", "llama3.icr", "llama3.prompt_pairs", "llama3.argilla", "llama3.ultra",
    "llama3.argilla_chat",
    # prompts to roll out (with `rl: grpo`), see data/prompts.py
    "prompt",
]
PREFERENCE_TYPES = get_args(DatasetType)[
    get_args(DatasetType).index("preference"):get_args(DatasetType).index("prompt")]
# The types rendered with the config's (or the entry's) `chat_template`.
RENDERED_WITH_TEMPLATE = ("chat_template", "chat_template.default", "chat_template.argilla")


# The chat templates longctx ships (data/chat_templates.py holds their text).
SHIPPED_CHAT_TEMPLATES = ("chatml", "llama3", "qwen3", "gemma3", "phi_3")
CHAT_TEMPLATE_FALLBACK = "tokenizer_default_fallback_"


def known_chat_template(name: str) -> bool:
    """A `chat_template` value longctx can render: the tokenizer's own, a shipped one, a
    fallback to a shipped one, or `jinja`."""
    if name.startswith(CHAT_TEMPLATE_FALLBACK):
        name = name[len(CHAT_TEMPLATE_FALLBACK):]
    return name in ("tokenizer_default", "jinja", *SHIPPED_CHAT_TEMPLATES)


def is_preference_type(type_: str) -> bool:
    """Whether a dataset type holds preference pairs (chosen and rejected answers)."""
    return type_ in PREFERENCE_TYPES


RlMethod = Literal["dpo", "ipo", "simpo", "orpo", "grpo"]
GrpoLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
_RL_NOT_YET = {
    "kto": "KTO (unpaired answers) is not supported yet",
}
DpoLossType = Literal["sigmoid", "hinge", "ipo", "robust"]
TrainOnEos = Literal["turn", "last", "all", "none"]


def unfrozen_pattern(pattern: str) -> tuple[re.Pattern[str], tuple[int, int | None] | None]:
    """An `unfrozen_parameters` entry in Axolotl's syntax: a regular expression matched from
    the start of a parameter name in which a `.` is a literal dot (except in `.+`; an
    escaped `\\.` stays as written), optionally followed by `[start:end]` (or `[i]`): only
    those rows of the parameter's first dimension train."""
    rows = None
    found = re.match(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$", pattern)
    if found:
        pattern, first, last = found.groups()
        if last is None and first.isdecimal():
            rows = (int(first), int(first) + 1)
        else:
            rows = (int(first or 0), int(last) if last else None)
            if rows[1] is not None and rows[0] >= rows[1]:
                raise ValueError(f"empty row range [{first}:{last}]")
    return re.compile(re.sub(r"(?<!\\)\.(?!\+)", r"\\.", pattern)), rows


class DatasetConfig(_Strict):
    """One entry of `datasets:` (or `eval_datasets:`, `pretraining_dataset:`)."""

    path: str | None = Field(
        None,
        description="Local file (.jsonl/.json/.csv/.parquet/.arrow/.txt), folder, or hub "
        "dataset id. Not needed for `type: passkey`.",
    )
    type: DatasetType = Field(
        "completion",
        description="completion: train on all tokens of `field`; alpaca (and the variants "
        "`alpaca:chat`, `alpaca:chatml`, `alpaca:phi`, `alpaca_chat`, `alpaca_instruct`, "
        "`alpaca_instruct.load_no_prompt`, `alpaca_w_system[.load_instruct|.load_chat]`): "
        "instruction/input/output records in Axolotl's prompt wording, train on the output; "
        "chat_template: render `field_messages` with the chat template, train on the turns of "
        "`roles_to_train`; input_output: `segments` of text with `label` true/false; "
        "pretrain: concatenate `field` and cut into `sequence_len` pieces; passkey: synthetic "
        "long-context retrieval samples. See docs/data.md.",
    )
    field: str = Field(
        "text",
        validation_alias=AliasChoices("field", "text_column"),
        description="Column holding the text (completion, pretrain).",
    )
    messages_field: str = Field(
        "messages",
        validation_alias=AliasChoices("field_messages", "messages_field"),
        description="Column holding the conversation (chat_template).",
    )
    message_property_mappings: dict[str, str] | None = Field(
        None,
        description="chat_template: message key -> key in your data, e.g. "
        "`{role: from, content: value}` for ShareGPT (default role/content).",
    )
    message_field_role: str | None = Field(
        None, description="chat_template (legacy): key of a turn's role; prefer "
        "`message_property_mappings`."
    )
    message_field_content: str | None = Field(
        None, description="chat_template (legacy): key of a turn's text; prefer "
        "`message_property_mappings`."
    )
    field_thinking: str | None = Field(
        None,
        description="chat_template: key of a turn's reasoning trace in your data; it is passed "
        "to the template as `template_thinking_key` and trained with the turn's content.",
    )
    template_thinking_key: str = Field(
        "reasoning_content",
        description="chat_template: the message key the template reads reasoning from "
        "(used with `field_thinking`).",
    )
    message_field_training: str | None = Field(
        None,
        description="chat_template: key of a per-turn boolean that overrides "
        "`roles_to_train` (default: `training`, else `train`).",
    )
    roles: dict[str, list[str]] | None = Field(
        None,
        description="chat_template: role -> the names your data uses for it, e.g. "
        "`{user: [human], assistant: [gpt]}` (default: human/user, gpt/assistant, system, "
        "tool). Replaces the default when given.",
    )
    field_chosen: str = Field(
        "chosen", description="chat_template.default (rl): column of the chosen answer (a "
        "message or a string)."
    )
    field_rejected: str = Field(
        "rejected", description="chat_template.default (rl): column of the rejected answer."
    )
    roles_to_train: list[str] = Field(
        default_factory=lambda: ["assistant"],
        description="chat_template: roles whose turns are targets (top-level "
        "`train_on_inputs: true` makes every turn a target).",
    )
    train_on_eos: TrainOnEos = Field(
        "turn",
        description="chat_template: which end-of-turn markers are targets: turn (after "
        "trained turns), last (only the last), all, none.",
    )
    chat_template: str | None = Field(
        None, description="chat_template: this entry's template (default: the top-level one)."
    )
    data_files: str | list[str] | None = Field(
        None,
        description="Files to read: relative to a local `path` folder (or the current "
        "directory without `path`), or inside a hub dataset.",
    )
    ds_type: Literal["json", "csv", "parquet", "text", "arrow"] | None = Field(
        None, description="File format when the file name does not say (e.g. `.data`)."
    )
    split: str = Field("train", description="Dataset split to load.")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(None, description="Hub dataset revision (branch, tag or commit).")
    shards: int | None = Field(
        None, ge=1, description="Keep only one of this many shards of the records (after a "
        "seeded shuffle), e.g. to try a config on a slice."
    )
    shards_idx: int = Field(0, ge=0, description="Which shard `shards` keeps.")
    num_samples: int = Field(
        256, ge=1, description="passkey: number of samples to generate."
    )
    context_lengths: list[int] | None = Field(
        None,
        description="passkey: lengths in tokens of the generated samples "
        "(default: `[sequence_len]`).",
    )
    depths: list[float] | None = Field(
        None,
        description="passkey: relative depths (0 = start, 1 = end) at which the key is hidden "
        "(default: 0.0, 0.1, ..., 1.0).",
    )
    key_length: int = Field(5, ge=1, le=64, description="passkey: number of digits of the key.")
    transform: str | None = Field(
        None, description="prompt (rl: grpo): an Axolotl GRPO dataset transform, "
        "`module.function` importable from the config's folder or the Python path; "
        "`function(cfg)` returns `transform_fn(example, tokenizer=None) -> {'prompt': ..., "
        "...}` (or that and `{'remove_columns': [...]}`). Written as `type: module.function`, "
        "as Axolotl does.",
    )
    seed: int | None = Field(
        None, description="passkey: generator seed (default: the top-level `seed`)."
    )

    @model_validator(mode="before")
    @classmethod
    def _transform_type(cls, data: Any) -> Any:
        # Axolotl names a GRPO dataset's Python transform in `type` (`rewards.gsm8k_transform`).
        if isinstance(data, dict) and isinstance(data.get("type"), str) and (
                data["type"] not in get_args(DatasetType)) and _is_import_path(data["type"]):
            data = {**data, "type": "prompt", "transform": data["type"]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        if self.shards is not None and self.shards_idx >= self.shards:
            raise ValueError(f"`shards_idx` {self.shards_idx} must be below `shards` "
                             f"({self.shards})")
        if self.path is None and self.data_files is None and self.type != "passkey":
            raise ValueError(f"a `{self.type}` dataset needs a `path` or `data_files`")
        return self


def _is_import_path(value: str) -> bool:
    """`module.function` (dotted Python names, at least one dot)."""
    return bool(re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value))


def is_reward_model(entry: str) -> bool:
    """A `trl.reward_funcs` entry that names a model (a folder path or a hub id: a `/` in
    it), not a `module.function`."""
    return "/" in entry or "\\" in entry


def _as_entries(value: Any) -> Any:
    """`pretraining_dataset` as Axolotl users write it: a path, one mapping, or a list."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        item = {"path": item} if isinstance(item, str) else item
        if isinstance(item, dict):
            item = {"type": "pretrain", **item}
        out.append(item)
    return out


class SpecialTokens(_Strict):
    """Axolotl's `special_tokens:` mapping; each token must already be in the vocabulary."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None


class FsdpConfig(_Strict):
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


Optimizer = Literal[
    # torch.optim
    "adamw", "adamw_torch", "adamw_torch_fused", "sgd",
    # bitsandbytes (runs on CPU too)
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "paged_adamw",
    "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit",
    # torchao low-bit states
    "adamw_torch_8bit", "adamw_torch_4bit", "ao_adamw_8bit", "ao_adamw_4bit", "ao_adamw_fp8",
]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "warmup_stable_decay",
]


_VLLM = ("longctx samples the rollouts itself, the prompt prefilled across the SP group; "
         "vLLM is not used")
_ADAPTIVE = "read only by `use_adaptive_entropy`, which is refused"
_TR_DPO = "read only by `sync_ref_model`, which is refused"
# `trl:` keys accepted and listed in the plan because they change nothing longctx computes.
# Every field of TRL's GRPOConfig is a TrlConfig field, here or in TRL_REFUSED
# (tests/test_grpo_keys.py); docs/axolotl.md has a row for each.
TRL_IGNORED: dict[str, str] = {
    "log_completions": "sample completions with their rewards are always written to "
    "output_dir/completions.jsonl at logging steps",
    "log_unique_prompts": "completions.jsonl holds every completion with its prompt",
    "log_multimodal": "prompts are text; nothing multimodal to log",
    "wandb_log_unique_prompts": "completions are logged to output_dir/completions.jsonl",
    "use_liger_loss": "longctx scores each rank's tokens through the head in blocks itself",
    "pad_to_multiple_of": "padding only shapes TRL's tensors (the padded tokens are masked); "
    "longctx packs each group in one row and pads it for the SP split itself",
    "cache_implementation": "longctx's rollout decoder keeps its own KV cache (sharded prompt, "
    "per-completion tail); the choice of cache changes no sampled token",
    "use_transformers_continuous_batching": "an engine choice for transformers' generate; "
    "longctx samples with its own SP decoder (the same model and sampling)",
    "transformers_continuous_batching_config": "read only by "
    "use_transformers_continuous_batching (see it)",
    "use_transformers_paged": "TRL's deprecated name of use_transformers_continuous_batching "
    "(see it)",
    "max_tool_calling_iterations": "read only with tools, which are refused",
    "entropy_coef_min": _ADAPTIVE,
    "entropy_coef_max": _ADAPTIVE,
    "entropy_coef_delta": _ADAPTIVE,
    "entropy_target": _ADAPTIVE,
    "ref_model_mixup_alpha": _TR_DPO,
    "ref_model_sync_steps": _TR_DPO,
    **{k: _VLLM for k in ("vllm_mode", "vllm_server_host", "vllm_server_port",
                          "vllm_server_timeout", "vllm_server_base_url", "vllm_group_port",
                          "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                          "vllm_enable_sleep_mode", "vllm_max_model_length",
                          "vllm_model_impl", "vllm_importance_sampling_correction",
                          "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
                          "vllm_importance_sampling_clip_min",
                          "vllm_importance_sampling_clip_max",
                          "vllm_guided_decoding_regex", "vllm_structured_outputs_regex")},
}
# `trl:` keys that would change what is computed, refused unless at TRL's default (or off).
TRL_REFUSED: dict[str, str] = {
    "use_vllm": "rollouts are sampled by longctx under SP (the prompt prefilled across the SP "
    "group, so a prompt longer than one device holds can be rolled out); serving them from "
    "vLLM is not implemented. Drop `use_vllm` (and the `vllm:` section)",
    "rollout_func": "custom rollout functions are not supported; longctx samples completions "
    "itself. Drop it",
    "sync_ref_model": "TR-DPO-style reference updates (mixing the policy into the reference "
    "every ref_model_sync_steps) are not implemented; the reference stays the initial model. "
    "Drop it",
    "use_adaptive_entropy": "the adaptive coefficient is state carried from one optimizer "
    "step to the next (and through checkpoints), which longctx's GRPO step does not keep yet. "
    "Use a fixed `entropy_coef` instead",
    "model_init_kwargs": "longctx loads the model from its own keys (base_model, dtype, "
    "attn_implementation, revision_of_model, ...). Drop it and set those",
    "trust_remote_code": "the model is loaded by longctx, not TRL. Set the top-level "
    "`trust_remote_code: true` instead",
    "log_completions_hub_repo": "longctx does not upload completions; they are written to "
    "output_dir/completions.jsonl. Drop it and upload that file",
    "generation_kwargs": "extra generation arguments are not supported. Use temperature, "
    "top_p, top_k, min_p, repetition_penalty",
    "chat_template_kwargs": "chat template arguments are not supported. Drop them and write "
    "the prompt's chat template into the data",
    "max_prompt_length": "prompts are kept whole; a prompt with no room for "
    "max_completion_length within sequence_len is dropped and counted. Drop it",
    "environment_factory": "environments and tool calls are not supported. Drop it",
    "tools": "tool calls are not supported. Drop them",
    "num_generations_eval": "held-out rollouts are not supported yet. Drop it",
}
# TRL's values of refused keys that ask for nothing (0.0: no auxiliary loss, as longctx).
_TRL_OFF: dict[str, tuple[object, ...]] = {}


class TrlConfig(_Strict):
    """Axolotl's `trl:` section for `rl: grpo`: TRL's GRPOConfig names, defaults and meaning."""

    reward_funcs: list[str] = Field(
        ..., min_length=1, description="Reward functions, `module.function` importable from the "
        "config's folder or the Python path, with TRL's signature: `f(prompts, completions, "
        "completion_ids, **columns) -> list[float | None]` (None: not applicable); or reward "
        "models, sequence-classification models scored under SP: a folder (a path with a "
        "`/`, relative to the config's folder: `./reward_model`) or a hub id already in the "
        "local cache (`org/name`).",
    )
    reward_processing_classes: list[str | None] | None = Field(
        None, description="One tokenizer per `reward_funcs` entry (a folder or hub id; null "
        "for functions and for a model scored with its own tokenizer).")
    reward_weights: list[float] | None = Field(
        None, description="Weight of each reward function (default 1 each).")
    num_generations: int = Field(
        8, ge=2, description="Completions sampled per prompt (a group); `micro_batch_size` "
        "counts completions and must be a multiple of it.")
    max_completion_length: int = Field(512, ge=1, description="New tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the "
                               "log-probabilities are scored at it too (as TRL does).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int | None = Field(0, ge=0, description="Top-k sampling (0 or null: off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Min-p sampling.")
    repetition_penalty: float = Field(1.0, gt=0, description="Repetition penalty.")
    beta: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference model "
                        "(0: no reference pass).")
    epsilon: float = Field(0.2, ge=0, description="Lower clip of the importance ratio.")
    epsilon_high: float | None = Field(
        None, ge=0, description="Upper clip (default: `epsilon`); cispo: the ratio's cap.")
    delta: float | None = Field(None, gt=0, description="Two-sided clipping: cap the ratio.")
    num_iterations: int = Field(
        1, ge=1, description="Optimizer steps per generation batch (> 1: the rollout-time "
        "log-probabilities are kept for the importance ratio).")
    scale_rewards: Literal["group", "batch", "none"] | bool = Field(
        "group", description="Divide advantages by the reward std of the group, the batch, or "
        "not at all (true: group, false: none).")
    loss_type: GrpoLossType = Field(
        "dapo", description="TRL's loss: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, "
        "vespo.")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="sequence: one ratio per completion (GSPO).")
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length out of the loss.")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How several reward functions become advantages.")
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the per-token KL by the importance ratio (TRL's default).")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: negative advantages.")
    vespo_k_pos: float = Field(2.0, description="vespo: the power k of the gamma weight "
                               "w^k e^(-lambda w) for advantages >= 0.")
    vespo_lambda_pos: float = Field(3.0, description="vespo: the decay lambda for advantages "
                                    ">= 0.")
    vespo_k_neg: float = Field(3.0, description="vespo: k for negative advantages.")
    vespo_lambda_neg: float = Field(2.0, description="vespo: lambda for negative advantages.")
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="Keep in the policy term only the tokens whose entropy is "
        "in this top fraction of the micro-batch's scored tokens (over every rank; 1: all).")
    entropy_coef: float = Field(
        0.0, description="Subtract this times the micro-batch's mean token entropy from the "
        "loss (an entropy bonus; fixed, see use_adaptive_entropy).")
    off_policy_mask_threshold: float | None = Field(
        None, gt=0, description="Drop the policy term of completions with a negative "
        "advantage whose mean log-ratio of rollout-time to current policy exceeds this "
        "(DeepSeek-V3.2's off-policy sequence mask).")
    cast_lm_head_to_fp32: bool = Field(
        False, description="Keep the head's weights in float32 and compute its logits in "
        "float32 from float32 hidden states (policy and reference; scoring and sampling).")
    shuffle_dataset: bool = Field(
        True, description="false: roll out prompts in the data's order (as "
        "`curriculum_sampling: true`).")
    generation_batch_size: int | None = Field(
        None, ge=1, description="Completions sampled per generation batch, over every "
        "data-parallel group (TRL: per_device_train_batch_size x processes x "
        "steps_per_generation, i.e. micro_batch_size x dp x steps_per_generation here); a "
        "multiple of micro_batch_size x dp and of num_generations. Not with "
        "steps_per_generation.")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Micro-batches (of each data-parallel group) per generation "
        "batch (default: gradient_accumulation_steps): one generation batch is split over "
        "steps_per_generation / gradient_accumulation_steps optimizer steps, as in TRL; a "
        "multiple of gradient_accumulation_steps (TRL would also start a batch inside a "
        "step; refused). Not with generation_batch_size.")
    disable_dropout: bool = Field(
        False, description="Dropout off in the rollout-time, reference and update passes (so "
        "the first importance ratio is exactly 1).")
    ds3_gather_for_generation: bool = Field(
        True, description="Under FSDP, gather the full weights once per rollout (true) or, "
        "where they do not fit, let data-parallel groups decode in lockstep, gathering each "
        "layer per generated token (false).")
    router_aux_loss_coef: float | None = Field(
        None, description="0.0: train a mixture-of-experts model with the GRPO loss alone (its "
        "routers still learn through it). TRL's default (null) adds the model's own "
        "coefficient x its load-balancing loss, which longctx does not compute: `validate` "
        "refuses such a model unless this is 0.0.")
    num_completions_to_print: int | None = Field(
        None, ge=0, description="Completions written per logging step (default: every one).")
    _ignored: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _axolotl_trl_keys(cls, data: Any, handler: Any) -> TrlConfig:
        ignored = []
        if isinstance(data, dict):
            data = dict(data)
            for key in list(data):
                if key in TRL_IGNORED:
                    ignored.append((key, TRL_IGNORED[key]))
                    data.pop(key)
                elif key in TRL_REFUSED:
                    value = data.pop(key)
                    if value not in _TRL_OFF.get(key, (None, False, "", [], {})):
                        raise ValueError(f"`trl.{key}: {value}` cannot run: "
                                         f"{TRL_REFUSED[key]}")
        model = handler(data)
        model._ignored = ignored
        return model

    @field_validator("router_aux_loss_coef")
    @classmethod
    def _no_aux_loss(cls, value: float | None) -> float | None:
        if value:
            raise ValueError(f"`trl.router_aux_loss_coef: {value}` cannot run: longctx trains "
                             "the GRPO loss without the mixture-of-experts load-balancing "
                             "loss. Set 0.0 (the loss longctx computes), or drop it")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrlConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(
                self.reward_funcs):
            raise ValueError(f"`reward_weights` has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward functions; give one per "
                             "function")
        for name in self.reward_funcs:
            if not (_is_import_path(name) or is_reward_model(name)):
                raise ValueError(f"reward function `{name}` must be `module.function` (e.g. "
                                 "`rewards.passkey_digits` for rewards.py beside the config), "
                                 "or a reward model's folder (`./reward_model`) or hub id "
                                 "(`org/name`)")
        classes = self.reward_processing_classes
        if classes is not None:
            if len(classes) != len(self.reward_funcs):
                raise ValueError(f"`reward_processing_classes` has {len(classes)} entries for "
                                 f"{len(self.reward_funcs)} reward functions; give one per "
                                 "entry of `reward_funcs` (null where none applies)")
            for name, tokenizer in zip(self.reward_funcs, classes, strict=True):
                if tokenizer is not None and not is_reward_model(name):
                    raise ValueError(f"`reward_processing_classes` gives `{tokenizer}` for "
                                     f"the reward function `{name}`; a tokenizer applies only "
                                     "to a reward model: set that entry to null")
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards,
                                                               self.scale_rewards)
        return self

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def generation_steps(self, dp: int, micro_batch_size: int,
                         gradient_accumulation_steps: int) -> int:
        """TRL's `steps_per_generation` at `dp` data-parallel groups: micro-batches of each
        group per generation batch (default: the accumulation). Raises ValueError (one
        paragraph naming the key) when `generation_batch_size` does not split evenly."""
        if self.steps_per_generation is not None:
            return self.steps_per_generation
        if self.generation_batch_size is None:
            return gradient_accumulation_steps
        per_micro_step = micro_batch_size * dp
        if self.generation_batch_size % per_micro_step:
            raise ValueError(
                f"`trl.generation_batch_size: {self.generation_batch_size}` must be a multiple "
                f"of micro_batch_size x data-parallel groups = {micro_batch_size} x {dp} = "
                f"{per_micro_step} (every group rolls out micro_batch_size completions per "
                "micro-batch); set it to a multiple of "
                f"{per_micro_step}, or give `trl.steps_per_generation` instead")
        return self.generation_batch_size // per_micro_step


class Config(_Strict):
    """A longctx run. Groups below are only for reading; the YAML is flat."""

    # ---- model ---------------------------------------------------------------------------
    base_model: str | None = Field(
        None, description="Hub id or local path of the model to fine-tune."
    )
    model_config_dict: dict[str, Any] | None = Field(
        None,
        alias="model_config",
        description="Inline model config (must contain `model_type`) to build a randomly "
        "initialised model instead of loading `base_model`; for tests and offline examples.",
    )
    reinit_weights: bool = Field(
        False,
        description="Start from random weights (drawn from `seed`) in `base_model`'s "
        "architecture and config, not its trained weights: pretraining from scratch.",
    )
    # ---- vision-language models (docs/vlm.md) --------------------------------------------
    processor_type: Literal["AutoProcessor"] | None = Field(
        None,
        description="Vision-language models: load the processor (image processor, tokenizer, "
        "chat template) from `processor_path` or `base_model` with transformers' "
        "AutoProcessor, offline. Set it (as Axolotl does) to train on image-bearing records.",
    )
    processor_path: str | None = Field(
        None,
        description="Folder of the processor's files when they are not beside `base_model` "
        "(e.g. with `model_config`). Relative paths are read from the config's folder.",
    )
    image_size: int | tuple[int, int] | None = Field(
        None,
        description="Resize every image before the processor, as Axolotl does: an int pads it "
        "to that square keeping its aspect ratio; `[width, height]` stretches it.",
    )
    image_resize_algorithm: Literal["bilinear", "bicubic", "lanczos"] = Field(
        "bilinear", description="The resampling filter `image_size` resizes with.",
    )
    freeze_mm_modules: bool = Field(
        False,
        description="Vision-language models: freeze the vision tower and the projector; only "
        "the language model trains (full fine-tune), or only its adapters (with `adapter`).",
    )
    unfrozen_parameters: list[str] | None = Field(
        None,
        description="Full fine-tuning of only the parameters whose names match one of these "
        "patterns (Axolotl's syntax: a regular expression matched from the start of the name "
        "in which `.` is a literal dot except in `.+`, e.g. `model.layers.3[0-1].mlp`; a "
        "trailing `[start:end]` trains only those rows, e.g. new token embeddings: the others "
        "get no gradient, though a `weight_decay` still decays them, as in Axolotl); the rest "
        "stay frozen. Not with `adapter`.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer path or hub id (default: `base_model`), or `byte` for the "
        "built-in byte-level tokenizer that needs no files.",
    )
    overrides_of_model_config: dict[str, Any] | None = Field(
        None,
        description="Fields that replace the model config's own before the model is built "
        "(Axolotl's key), e.g. `{attention_dropout: 0.0}`; `validate`, the fidelity probe and "
        "training all use the overridden config.",
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Extend the model's context (Axolotl's key): `{type: yarn | linear | "
        "llama3, factor: N | auto, ...}` with the scaling's own fields (`beta_fast`, "
        "`low_freq_factor`, `original_max_position_embeddings`, ...). `factor: auto` is "
        "sequence_len / the model's native context, rounded up. Becomes the model config's "
        "`rope_parameters`, so validate, training and every saved config.json carry it; "
        "`dynamic` and `longrope` are refused (they depend on each forward's length).",
    )
    rope_theta: float | None = Field(
        None, gt=0,
        description="The RoPE base (Axolotl's key), replacing the model's own in "
        "`rope_parameters` (training and saved configs).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Allow model/tokenizer code from the hub to run. Off unless you trust it.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Dtype of the model weights and compute (Axolotl's `bf16`/`fp16` map here).",
    )
    base_model_config: str | None = Field(
        None,
        description="Where to read the model's config.json if not beside `base_model`.",
    )
    special_tokens: SpecialTokens | None = Field(
        None,
        description="Tokenizer special tokens to set (bos_token, eos_token, pad_token, "
        "unk_token); each must already be one token of the vocabulary.",
    )
    tf32: bool | Literal["auto"] = Field(
        False, description="Allow TF32 matmuls on Ampere+ GPUs (`auto`: same as true)."
    )

    # ---- data ----------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(
        default_factory=list, description="Training datasets (see the dataset keys below)."
    )
    eval_datasets: list[DatasetConfig] = Field(
        default_factory=list,
        description="Held-out datasets for eval loss and per-position loss "
        "(default: split off `val_set_size` of `datasets`).",
    )
    sequence_len: int = Field(
        4096, ge=2, description="Tokens per packed row (the context length trained on)."
    )
    sample_packing: bool = Field(
        True,
        description="Pack several samples into each row (first-fit-decreasing); "
        "position_ids restart at every document.",
    )
    sample_packing_sequentially: bool = Field(
        False,
        description="Pack samples in their order (a new row whenever the next does not fit) "
        "instead of first-fit-decreasing: keeps a curriculum's order, fills rows less.",
    )
    curriculum_sampling: bool = Field(
        False,
        description="Train on the rows in their order (no shuffle per epoch; a held-out "
        "`val_set_size` leaves the rest in order). With `shuffle_merged_datasets: false` and "
        "`sample_packing_sequentially: true` the data's own order is the training order.",
    )
    excess_length_strategy: Literal["drop", "truncate", "error"] = Field(
        "drop", description="What to do with samples longer than `sequence_len`."
    )
    dataset_prepared_path: str | None = Field(
        None,
        description="Where `preprocess` caches the tokenized, packed dataset "
        "(default: `<output_dir>/prepared`).",
    )
    val_set_size: float = Field(
        0.0,
        ge=0.0,
        description="Fraction (<1) or number (>=1) of packed rows held out for evaluation.",
    )
    num_proc: int | None = Field(
        None, ge=1, description="Processes for tokenization (default: all cores)."
    )
    chat_template: str = Field(
        "tokenizer_default",
        description="Chat template for `chat_template` datasets: tokenizer_default (the "
        "tokenizer's own), chatml, llama3, qwen3, gemma3, phi_3 (shipped with longctx), "
        "jinja (`chat_template_jinja`), or tokenizer_default_fallback_<name>.",
    )
    chat_template_jinja: str | None = Field(
        None, description="Jinja text of the template, or a path to a .jinja file, for "
        "`chat_template: jinja`."
    )
    train_on_inputs: bool = Field(
        False,
        description="Also train on prompts: alpaca instructions/inputs, every chat turn, "
        "input_output segments labelled false.",
    )
    shuffle_merged_datasets: bool = Field(
        True,
        description="Shuffle the samples of all datasets together before packing and the "
        "packed rows after (false: keep file order in the cache; the trainer still draws "
        "rows in a seeded order).",
    )
    pretraining_dataset: list[DatasetConfig] | None = Field(
        None,
        description="Datasets streamed during training instead of `datasets` (type "
        "`pretrain`, column `text_column`), packed on the fly into `sequence_len` rows; "
        "needs `max_steps`. A path, one mapping or a list.",
    )
    streaming: bool | None = Field(
        None, description="Stream `pretraining_dataset` (the only way it is read; "
        "`false` is refused)."
    )

    # ---- parallelism ---------------------------------------------------------------------
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
    dp_replicate_size: int | None = Field(
        None, ge=1, description="Replicas of the sharded weights (HSDP when > 1 with FSDP)."
    )
    world_size: int | None = Field(
        None,
        ge=1,
        description="Number of ranks assumed by `validate` when neither --nproc-per-node "
        "nor a torchrun environment says.",
    )

    # ---- training ------------------------------------------------------------------------
    micro_batch_size: int = Field(1, ge=1, description="Packed rows per rank per forward pass.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step."
    )
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training rows.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (overrides num_epochs)."
    )
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate.")
    lr_scheduler: Scheduler = Field(
        "cosine", description="Schedule (any transformers.get_scheduler name)."
    )
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the schedule, e.g. `{num_cycles: 2}`."
    )
    cosine_min_lr_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="cosine: decay to this fraction of learning_rate (cosine_with_min_lr).",
    )
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps (default 0).")
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="Warm-up as a fraction of the total steps."
    )
    optimizer: Optimizer = Field(
        "adamw",
        description="adamw/adamw_torch/adamw_torch_fused: torch AdamW; sgd; bitsandbytes "
        "adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit/32bit, lion_8bit/32bit (`pip install "
        "'longctx[bnb]'`); torchao adamw_torch_8bit/4bit, ao_adamw_8bit/4bit/fp8 "
        "(`pip install 'longctx[torchao]'`).",
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, description="Clip the global gradient norm to this (null: no clipping)."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in backward to save activation memory "
        "(Axolotl's `offload` also turns on activation_offloading).",
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="Passed to transformers (default `{use_reentrant: false}`)."
    )
    chunked_loss: bool = Field(
        False,
        description="For heads the fused loss does not serve (LoRA'd or quantized head, "
        "FSDP2, TP, a logit transform, fp16): lm_head + cross-entropy in token chunks with "
        "recomputation, never materialising the [tokens, vocab] logits. A plain head's loss "
        "is always fused (blocks of logits, no recompute); this sets its block to "
        "`loss_chunk_size` tokens.",
    )
    loss_chunk_size: int = Field(
        4096, ge=1, description="Tokens per chunk (and per fused-loss block) when "
        "`chunked_loss` is on."
    )
    activation_offloading: bool = Field(
        False,
        description="Keep activations saved for backward in host memory (Axolotl's `legacy`, "
        "`disk` and `hidden_states` all mean true here).",
    )
    tiled_mlp: bool = Field(
        False, description="Run each MLP over the local tokens in tiles, recomputed in backward."
    )
    tiled_mlp_tiles: int | None = Field(
        None, ge=1, description="Number of MLP tiles (default: tokens / hidden_size, at least 1)."
    )
    host_mmap_threshold_mib: int | None = Field(
        None, ge=1,
        description="glibc's mmap threshold for every rank, in MiB: blocks from this size up "
        "are mapped on their own and given back when freed, so freed activations do not stay "
        "resident as heap fragments (a CPU rank's memory follows what is alive; each large "
        "block costs fresh pages). Unset: glibc's own, or your MALLOC_MMAP_THRESHOLD_.",
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="stop: a NaN/inf loss or gradient ends the run (the last checkpoint is "
        "kept); skip: drop that optimizer step and continue.",
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations in a row without a new best "
        "eval loss."
    )
    loss_watchdog_threshold: float | None = Field(
        None, gt=0, description="Stop when the training loss stays above this (see patience)."
    )
    loss_watchdog_patience: int = Field(
        3, ge=1, description="Steps in a row above loss_watchdog_threshold before stopping."
    )
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")
    strict: bool = Field(
        False,
        description="Command-line overrides may only replace keys the file already has.",
    )
    collective_timeout_s: int = Field(
        300,
        ge=10,
        description="Seconds a collective may wait before the job is declared hung and stopped.",
    )

    # ---- adapter -------------------------------------------------------------------------
    adapter: Literal["lora", "qlora"] | None = Field(
        None, description="lora, qlora (LoRA on a 4-bit base), or null for full fine-tuning."
    )
    load_in_4bit: bool = Field(
        False, description="Quantize the base weights to 4 bits (bitsandbytes NF4); needs an "
        "adapter. With `fsdp` the packed weights are sharded too (FSDP-QLoRA); not with TP."
    )
    load_in_8bit: bool = Field(
        False, description="Quantize the base weights to 8 bits (bitsandbytes); needs an "
        "adapter; not with FSDP or TP."
    )
    bnb_config_kwargs: dict[str, Any] | None = Field(
        None, description="Extra BitsAndBytesConfig arguments, e.g. `{bnb_4bit_quant_type: fp4}`."
    )
    lora_model_dir: str | None = Field(
        None, description="Continue training this saved LoRA adapter instead of a new one."
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] | str | None = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt, or `all-linear`.",
    )
    lora_target_linear: bool = Field(
        False, description="Adapt every linear layer (same as `lora_target_modules: all-linear`)."
    )
    lora_modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full beside the adapter, e.g. [lm_head]."
    )
    peft_use_dora: bool = Field(False, description="DoRA: weight-decomposed LoRA.")
    peft_use_rslora: bool = Field(False, description="rsLoRA: scale by alpha / sqrt(r).")

    # ---- preference optimisation ---------------------------------------------------------
    rl: RlMethod | None = Field(
        None,
        description="Train on preference pairs instead of the causal-LM loss: dpo (with "
        "`dpo_loss_type`), ipo (dpo with the ipo loss), simpo (no reference model), orpo (NLL "
        "of the chosen sequences plus an odds-ratio term; no reference model); these need "
        "preference datasets (docs/preference.md). grpo: online RL on prompt datasets, "
        "completions sampled under SP and scored by the `trl.reward_funcs` (docs/rl.md).",
    )
    trl: TrlConfig | None = Field(
        None, description="rl: grpo: the GRPO settings, under TRL's and Axolotl's names "
        "(`reward_funcs`, `num_generations`, `max_completion_length`, `beta`, `loss_type`, "
        "...). See docs/rl.md.",
    )
    rl_beta: float | None = Field(
        None, gt=0, validation_alias=AliasChoices("rl_beta", "dpo_beta"),
        description="beta: how far the policy may move from the reference (dpo, ipo: the "
        "regularisation tau); simpo: the reward scale; orpo: the odds-ratio term's weight, "
        "also set by `orpo_alpha` (default 0.1, TRL's).",
    )
    orpo_alpha: float | None = Field(
        None, gt=0, description="orpo: the weight of the odds-ratio term (TRL's ORPO `beta`; "
        "Axolotl's name for it). The same as `rl_beta` there.",
    )
    dpo_loss_type: list[DpoLossType] | None = Field(
        None, description="dpo: TRL's loss type(s): sigmoid (default), hinge, ipo, robust; "
        "several are summed with `dpo_loss_weights`."
    )
    dpo_loss_weights: list[float] | None = Field(
        None, description="dpo: weight of each `dpo_loss_type` (default 1 each)."
    )
    dpo_label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5,
        description="robust (dpo) and simpo: the probability that a preference label is "
        "flipped.",
    )
    simpo_gamma: float = Field(
        0.5, ge=0.0, description="simpo: the target reward margin gamma (TRL's default 0.5)."
    )
    cpo_alpha: float = Field(
        0.0, ge=0.0, description="simpo: weight of an NLL term on the chosen sequences; only "
        "0 (SimPO as published) is supported."
    )
    prefix_sharing: bool = Field(
        False, description="rl (not orpo): each pair's prompt once in the row, the rejected "
        "answer a branch after it that attends to the prompt and to itself, not to the chosen "
        "answer (positions go on from the prompt). The same losses and gradients as unshared "
        "pairs, one prompt's worth of compute and memory less per pair. Needs attention in "
        "every layer and no sliding window or chunked attention. See docs/preference.md. "
        "rl: grpo: on unless set to false (each prompt once for its `num_generations` "
        "completions; docs/rl.md).",
    )
    precompute_ref_log_probs: bool = Field(
        False, description="dpo/ipo with a new adapter: compute the reference log-probabilities "
        "once before training instead of switching the adapter off at every step (a full "
        "fine-tune or `lora_model_dir` always does; saved in output_dir for resumes)."
    )

    # ---- evaluation ----------------------------------------------------------------------
    eval_steps: int | float | None = Field(
        None,
        gt=0,
        description="Compute eval loss every this many optimizer steps (< 1: that fraction "
        "of the total steps).",
    )
    evals_per_epoch: int | None = Field(
        None, ge=0,
        description="Compute eval loss this many times per epoch (0: never, as in Axolotl).",
    )
    eval_strategy: Literal["no", "steps", "epoch"] | None = Field(
        None, description="no: never; epoch: once per epoch; steps (or null): per eval_steps."
    )
    eval_tasks: list[str] = Field(
        ["passkey", "position_loss"],
        description="`longctx eval` evaluations: `passkey` (grid, teacher-forced), "
        "`position_loss` (held-out loss by position), RULER's synthetic tasks by name "
        "(`niah_single_1`..`_3`, `niah_multikey_1`..`_3`, `niah_multivalue`, "
        "`niah_multiquery`, `vt`, `cwe`, `fwe`; greedy generation under SP) or `ruler` for all "
        "of them. See docs/eval.md.",
    )
    eval_context_lengths: list[int] | None = Field(
        None,
        description="`longctx eval` lengths of the passkey grid and the RULER tasks (default: 4 "
        "lengths up to sequence_len).",
    )
    eval_depths: list[float] | None = Field(
        None, description="`longctx eval` passkey grid depths (default: 0.0, 0.25, ..., 1.0)."
    )
    eval_samples_per_cell: int = Field(
        4, ge=1, description="`longctx eval` passkey samples per (length, depth) cell."
    )
    eval_ruler_samples: int = Field(
        4, ge=1, description="`longctx eval` samples per (RULER task, length)."
    )
    eval_position_buckets: int = Field(
        16, ge=1, description="`longctx eval` number of position buckets for per-position loss."
    )

    # ---- output --------------------------------------------------------------------------
    output_dir: str = Field("./outputs", description="Where metrics, checkpoints and final/ go.")
    save_steps: int | float | None = Field(
        None,
        gt=0,
        description="Write a resumable checkpoint every this many optimizer steps (< 1: that "
        "fraction of the total steps).",
    )
    saves_per_epoch: int | None = Field(
        None, ge=1, description="Write this many checkpoints per epoch."
    )
    save_strategy: Literal["no", "steps", "epoch"] | None = Field(
        None, description="no: never; epoch: once per epoch; steps (or null): per save_steps."
    )
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep only the newest this many checkpoints."
    )
    logging_steps: int = Field(1, ge=1, description="Print a log line every this many steps.")
    use_tensorboard: bool = Field(False, description="Also log metrics to TensorBoard.")
    use_wandb: bool | None = Field(
        None, description="Log to Weights & Biases (default: on when wandb_project is set)."
    )
    wandb_project: str | None = Field(None, description="Weights & Biases project.")
    wandb_entity: str | None = Field(None, description="Weights & Biases team or user.")
    wandb_name: str | None = Field(None, description="Weights & Biases run name.")
    wandb_run_id: str | None = Field(None, description="Weights & Biases run id (to resume one).")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="Weights & Biases mode (default: WANDB_MODE, else online)."
    )
    wandb_watch: Literal["gradients", "parameters", "all", "false"] | None = Field(
        None, description="wandb.watch the model's gradients and/or parameters."
    )
    wandb_log_model: Literal["checkpoint", "end", "false"] | None = Field(
        None, description="Upload the final model (`end`) or every checkpoint as an artifact."
    )
    resume_from_checkpoint: str | None = Field(
        None, description="`auto` (newest complete checkpoint in output_dir) or a checkpoint path. "
        "A preempted run's output_dir (it holds `preempted.json`) resumes as `auto` unset."
    )
    merge_lora: bool = Field(
        False,
        description="After a LoRA/QLoRA run, write the adapter merged into its base to "
        "`<output_dir>/merged` (as `longctx merge-lora` does; a QLoRA base is dequantised "
        "first).",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Restart the worker group this many times after a rank dies or hangs; the "
        "new workers resume from the newest intact checkpoint. A fault that repeats at the "
        "same step, or a user error (config, data, NaN), is not retried.",
    )
    step_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A worker group that finishes no optimizer step for this long (a stuck "
        "collective, a stopped rank) is stopped, the stuck rank named; restarted if "
        "`max_restarts` allows. Unset: no limit.",
    )
    preemption_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = Field(
        ["SIGTERM", "SIGUSR1"],
        description="Signals (to the launcher or any rank) that make every rank finish the "
        "current optimizer step, write a checkpoint and exit with status 75 (preempted, "
        "resumable). SLURM: `#SBATCH --signal=USR1@120`.",
    )
    preemption_grace_s: int = Field(
        600,
        ge=1,
        description="How long the launcher lets the ranks finish their step and save after a "
        "preemption signal before it kills them (torchrun's shutdown timeout).",
    )
    fidelity_probe: bool = Field(
        True,
        description="Before training (and in `validate`), check on a tiny random model of the "
        "same family that longctx computes exactly the model's own loss and gradients; refuse "
        "to train on any difference. `false` skips the check (docs/families.md).",
    )

    @model_validator(mode="after")
    def _chat_template_names(self) -> Config:
        # Checked where a dataset renders with it: a config may name a template it never uses.
        for entry in [*self.datasets, *self.eval_datasets]:
            name = entry.chat_template or self.chat_template
            if entry.type in RENDERED_WITH_TEMPLATE and not (
                    known_chat_template(name)):
                raise ValueError(
                    f"`chat_template: {name}` is not a template longctx has; it ships "
                    f"{', '.join(SHIPPED_CHAT_TEMPLATES)}: use one of them, tokenizer_default "
                    "(the tokenizer's own), or `jinja` with the template's text in "
                    "`chat_template_jinja`")
        return self

    @field_validator("rl", mode="before")
    @classmethod
    def _rl_method(cls, value: Any) -> Any:
        if value is None or value in get_args(RlMethod):
            return value
        why = _RL_NOT_YET.get(value, "it is an online method (it generates while it trains), "
                              "which longctx does not run")
        raise ValueError(f"`rl: {value}` cannot run: {why}; longctx trains "
                         f"{', '.join(get_args(RlMethod))}")

    @field_validator("dpo_loss_type", mode="before")
    @classmethod
    def _loss_type_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _preference_rules(self) -> Config:
        entries = [*self.datasets, *self.eval_datasets]
        if self.trl is not None and self.rl != "grpo":
            raise ValueError("`trl:` holds the settings of `rl: grpo`; set `rl: grpo`, or drop "
                             "the section")
        if self.rl == "grpo":
            return self._grpo_rules()
        prompts = [e for e in entries if e.type == "prompt"]
        if prompts:
            what = (f"`type: {prompts[0].transform}` (a Python transform)" if
                    prompts[0].transform else "`type: prompt`")
            raise ValueError(f"{what} holds prompts to roll out, which train with `rl: grpo`; "
                             "set `rl: grpo` (and its `trl:` section), or use an SFT type")
        pairs = [e.type for e in entries if is_preference_type(e.type)]
        if self.rl is None and self.prefix_sharing:
            raise ValueError("`prefix_sharing: true` shares a preference pair's prompt between "
                             "its answers; set `rl` (dpo, ipo or simpo), or drop it")
        if self.rl is None:
            if pairs:
                raise ValueError(f"`type: {pairs[0]}` holds preference pairs, which train with "
                                 "`rl:` (dpo, ipo, simpo or orpo); set `rl`, or use an SFT type")
            return self
        others = [e.type for e in entries if not is_preference_type(e.type)]
        if others or not self.datasets:
            raise ValueError(f"`rl: {self.rl}` trains on preference pairs, but a dataset has "
                             f"`type: {others[0] if others else '(none)'}`; use a preference type "
                             f"({', '.join(PREFERENCE_TYPES)})")
        if self.pretraining_dataset:
            raise ValueError("`rl` trains on preference pairs, not a `pretraining_dataset`")
        if self.excess_length_strategy == "truncate":
            raise ValueError("`excess_length_strategy: truncate` would cut a pair's answers off; "
                             "with `rl` pairs longer than sequence_len are dropped and counted "
                             "(`drop`, the default)")
        if self.prefix_sharing and self.rl == "orpo":
            raise ValueError("`prefix_sharing: true` with `rl: orpo`: ORPO tokenizes each "
                             "answer's prompt on its own (the two may differ in their last "
                             "token), and sharing is not implemented for that; drop one of "
                             "them")
        if self.orpo_alpha is not None and self.rl != "orpo":
            raise ValueError(f"`orpo_alpha: {self.orpo_alpha}` weighs ORPO's odds-ratio term; "
                             f"`rl: {self.rl}` does not read it: drop it, or set `rl: orpo`")
        losses = self.dpo_loss_type
        if self.rl == "orpo":
            if losses is not None:
                raise ValueError("`dpo_loss_type` chooses a dpo loss; `rl: orpo` has its own: "
                                 "drop it")
            if (self.orpo_alpha is not None and self.rl_beta is not None
                    and self.orpo_alpha != self.rl_beta):
                raise ValueError(f"`orpo_alpha: {self.orpo_alpha}` and `rl_beta: "
                                 f"{self.rl_beta}` both set ORPO's beta; keep one")
            if self.dpo_label_smoothing:
                raise ValueError(f"`dpo_label_smoothing: {self.dpo_label_smoothing}` is not "
                                 "read by ORPO (TRL's ORPOTrainer has no label smoothing): drop "
                                 "it")
            if self.precompute_ref_log_probs:
                raise ValueError("`precompute_ref_log_probs: true`: ORPO has no reference "
                                 "model; drop it")
        elif self.rl == "ipo":
            if losses not in (None, ["ipo"]):
                raise ValueError(f"`rl: ipo` is dpo with the ipo loss; `dpo_loss_type: "
                                 f"{losses}` contradicts it: drop it, or use `rl: dpo`")
            losses = ["ipo"]
        elif self.rl == "simpo":
            if losses is not None:
                raise ValueError("`dpo_loss_type` chooses a dpo loss; `rl: simpo` has its own: "
                                 "drop it")
            if self.cpo_alpha:
                raise ValueError(f"`cpo_alpha: {self.cpo_alpha}` adds an NLL term over the "
                                 "chosen prompt and answer, which longctx does not compute yet; "
                                 "set it to 0 (SimPO as published)")
        else:
            losses = losses or ["sigmoid"]
        if losses and self.dpo_loss_weights is not None and (
                len(self.dpo_loss_weights) != len(losses)):
            raise ValueError(f"`dpo_loss_weights` has {len(self.dpo_loss_weights)} weights for "
                             f"{len(losses)} loss types; give one per `dpo_loss_type`")
        if self.dpo_label_smoothing and losses and "robust" not in losses:
            raise ValueError(f"`dpo_label_smoothing: {self.dpo_label_smoothing}` is read only by "
                             f"the robust loss (TRL ignores it for {', '.join(losses)}); set "
                             "`dpo_loss_type: robust`, or drop it")
        self.dpo_loss_type = losses
        return self

    def _grpo_rules(self) -> Config:
        if self.trl is None:
            raise ValueError("`rl: grpo` needs a `trl:` section with at least `reward_funcs` "
                             "(e.g. `trl: {reward_funcs: [rewards.passkey_digits], "
                             "num_generations: 4}`); see docs/rl.md")
        if not self.datasets or self.pretraining_dataset:
            raise ValueError("`rl: grpo` rolls out the prompts of `datasets` (`type: prompt`, "
                             "or an Axolotl transform `type: module.function`); add one")
        for entry in self.datasets:
            if "type" not in entry.model_fields_set:
                entry.type = "prompt"  # a GRPO dataset is a prompt dataset
            if entry.type != "prompt":
                raise ValueError(f"`rl: grpo` rolls out prompts, but a dataset has `type: "
                                 f"{entry.type}`; use `type: prompt` (a `prompt` column: text "
                                 "or chat messages) or an Axolotl transform "
                                 "`type: module.function`")
        if self.eval_datasets or self.val_set_size:
            raise ValueError("held-out rollouts are not supported yet with `rl: grpo`: drop "
                             "`eval_datasets` / `val_set_size` (evaluate the saved model with "
                             "`longctx eval`)")
        if self.tensor_parallel_size > 1:
            raise ValueError("`rl: grpo` with `tensor_parallel_size` > 1: the update would run "
                             "(TP-sp scores GRPO exactly, tests/test_grpo.py), but rollouts "
                             "cannot. TP-sp shards every activation along the sequence over "
                             "the TP group, and a decode step has one token per sequence; the "
                             "sampler also needs each token's whole-vocabulary logits, which "
                             "the vocab-parallel head splits. Decoding under TP is not "
                             "implemented. Use sequence (and data) parallelism, with FSDP for "
                             "memory (rollouts then gather the weights once)")
        for key in ("rl_beta", "orpo_alpha", "dpo_loss_type"):
            if getattr(self, key) is not None:
                raise ValueError(f"`{key}` is a preference-loss key; `rl: grpo` reads its "
                                 f"settings from `trl:` (the KL weight is `trl.beta`): drop it")
        trl = self.trl
        if self.micro_batch_size % trl.num_generations:
            raise ValueError(
                f"`micro_batch_size: {self.micro_batch_size}` counts completions (TRL's "
                f"per_device_train_batch_size) and must be a multiple of "
                f"`trl.num_generations: {trl.num_generations}` so that every prompt's group "
                f"sits in one row with the prompt once; set micro_batch_size to "
                f"{trl.num_generations} (or a multiple)")
        if trl.steps_per_generation is not None and trl.generation_batch_size is not None:
            raise ValueError(
                f"`trl.generation_batch_size: {trl.generation_batch_size}` and "
                f"`trl.steps_per_generation: {trl.steps_per_generation}` say the same thing "
                "twice (generation_batch_size = micro_batch_size x data-parallel groups x "
                "steps_per_generation, as in TRL); give only one of them")
        if trl.generation_batch_size is not None:
            # The data-parallel degree is known only at launch (`generation_steps`); what
            # holds at any degree is checked here.
            for name, unit in (("micro_batch_size", self.micro_batch_size),
                               ("trl.num_generations", trl.num_generations)):
                if trl.generation_batch_size % unit:
                    raise ValueError(
                        f"`trl.generation_batch_size: {trl.generation_batch_size}` must be a "
                        f"multiple of `{name}: {unit}` (a generation batch is micro_batch_size "
                        "completions per data-parallel group per micro-batch, whole prompt "
                        f"groups); set it to a multiple of {self.micro_batch_size} x the "
                        "data-parallel groups, or give `trl.steps_per_generation` instead")
        if self.tensor_parallel_size > 1 and (trl.top_entropy_quantile < 1
                                               or trl.entropy_coef):
            key = "top_entropy_quantile" if trl.top_entropy_quantile < 1 else "entropy_coef"
            raise ValueError(
                f"`trl.{key}: {getattr(trl, key)}` reads each token's entropy, which the "
                "vocab-parallel head under `tensor_parallel_size` > 1 does not compute; drop "
                f"`trl.{key}` or use sequence parallelism without TP")
        if not trl.shuffle_dataset:
            if "curriculum_sampling" in self.model_fields_set and not self.curriculum_sampling:
                raise ValueError("`trl.shuffle_dataset: false` and `curriculum_sampling: false` "
                                 "disagree (shuffle the prompts or not); drop one of them")
            self.curriculum_sampling = True  # TRL's unshuffled sampler: the data's order
        if trl.max_completion_length >= self.sequence_len:
            raise ValueError(
                f"`trl.max_completion_length: {trl.max_completion_length}` leaves no room for "
                f"a prompt within `sequence_len: {self.sequence_len}` (prompt + completion); "
                "raise sequence_len or lower max_completion_length")
        if "prefix_sharing" not in self.model_fields_set:
            self.prefix_sharing = True  # the long prompt once per group, unless asked not to
        self._axolotl_notes.extend((f"trl.{key}", f"ignored: {why}")
                                   for key, why in trl._ignored)
        return self

    @field_validator("pretraining_dataset", mode="before")
    @classmethod
    def _pretraining_entries(cls, value: Any) -> Any:
        return _as_entries(value)

    @model_validator(mode="after")
    def _streamed_data(self) -> Config:
        if not self.pretraining_dataset:
            return self
        if any(e.type != "pretrain" for e in self.pretraining_dataset):
            raise ValueError("`pretraining_dataset` entries must be `type: pretrain`")
        if self.streaming is False:
            raise ValueError("`pretraining_dataset` is always streamed; drop `streaming: false` "
                             "or list the files under `datasets` with `type: pretrain`")
        if self.max_steps is None:
            raise ValueError("`pretraining_dataset` is streamed, so its length is unknown: "
                             "set `max_steps`")
        if self.datasets:
            raise ValueError("use either `datasets` or `pretraining_dataset`, not both")
        if self.eval_datasets or self.val_set_size:
            # Not silently ignored: a streamed run has no prepared eval rows yet.
            raise ValueError("eval data (`eval_datasets`, `val_set_size`) is not supported "
                             "with `pretraining_dataset` yet")
        return self

    # (key, how it was handled) for every Axolotl key the loader mapped or ignored, and the
    # DeepSpeed mapping; the plan prints them.
    _axolotl_notes: list[tuple[str, str]] = PrivateAttr(default_factory=list)
    # The folder of the config file (set by `load_config`): reward functions and dataset
    # transforms (`module.function`) are imported from it first.
    _source_dir: str | None = PrivateAttr(default=None)

    @field_validator("activation_offloading", mode="before")
    @classmethod
    def _offload_modes(cls, value: Any) -> Any:
        # Axolotl's offload flavours all keep saved activations off the GPU.
        return True if value in ("legacy", "disk", "hidden_states") else value

    @model_validator(mode="before")
    @classmethod
    def _checkpointing_offload(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gradient_checkpointing") in (
            "offload", "offload_disk"
        ):
            data = {**data, "gradient_checkpointing": True}
            data.setdefault("activation_offloading", True)
        return data

    @property
    def axolotl_notes(self) -> list[tuple[str, str]]:
        return self._axolotl_notes

    @property
    def trains_images(self) -> bool:
        """The run reads image-bearing records through a processor (`processor_type`): a
        model with its own causal LM (Gemma 3) then trains as a vision-language model."""
        return bool(self.processor_type)

    @model_validator(mode="after")
    def _axolotl_rules(self) -> Config:
        """Cross-key rules of the Axolotl keys, and the distribution keys folded into fsdp."""
        pairs = (("warmup_steps", "warmup_ratio"), ("save_steps", "saves_per_epoch"),
                 ("eval_steps", "evals_per_epoch"))
        for a, b in pairs:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ValueError(f"`{a}` and `{b}` say the same thing twice; keep one")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("`load_in_4bit` and `load_in_8bit` are both on; choose one")
        if self.adapter == "qlora" and not self.load_in_4bit:
            if self.load_in_8bit:
                raise ValueError("`adapter: qlora` is LoRA on a 4-bit base; set "
                                 "`load_in_4bit: true` instead of load_in_8bit")
            self.load_in_4bit = True  # what qlora means
        if (self.load_in_4bit or self.load_in_8bit) and self.adapter is None:
            raise ValueError("a quantized base (`load_in_4bit`/`load_in_8bit`) cannot be "
                             "trained in full; set `adapter: lora` (or qlora)")
        if self.lora_model_dir and self.adapter is None:
            raise ValueError("`lora_model_dir` continues an adapter; set `adapter: lora`")
        if self.lora_target_linear:
            self.lora_target_modules = "all-linear"
        if self.deepspeed is not None and (self.fsdp_config is not None or self.fsdp_version):
            raise ValueError("`deepspeed` and `fsdp_config`/`fsdp_version` both choose the "
                             "sharding; keep one")
        if self.deepspeed is not None:
            from longctx_cli.config.axolotl import map_deepspeed

            ds = map_deepspeed(self.deepspeed)  # MappingProblem is a ValueError
            self._axolotl_notes.append(("deepspeed", ds.note()))
            if ds.fsdp:
                self.fsdp = True
                self.fsdp_config = FsdpConfig(
                    reshard_after_forward=ds.reshard_after_forward,
                    offload_params=ds.offload_params or ds.offload_optimizer,
                )
        elif self.fsdp_config is not None or self.fsdp_version:
            self.fsdp = True
            if self.fsdp_version == 1 or (self.fsdp_config and self.fsdp_config.fsdp_version == 1):
                self._axolotl_notes.append(("fsdp_version", "1 runs as FSDP2 (same sharding)"))
        if self.fsdp_config is not None and self.fsdp_config.activation_checkpointing:
            self.gradient_checkpointing = True
        if self.dp_shard_size is not None and self.dp_shard_size > 1:
            self.fsdp = True
        if self.early_stopping_patience is not None and not (
            self.eval_steps or self.evals_per_epoch or self.eval_strategy == "epoch"
        ):
            raise ValueError("`early_stopping_patience` needs evaluations: set `eval_steps`, "
                             "`evals_per_epoch` or `eval_strategy: epoch`")
        return self

    @model_validator(mode="after")
    def _ring_layout(self) -> Config:
        # A named ring or sharding is resolved here, once (a P2P ring's name fixes its
        # sharding; a contradiction is refused at its line). Neither named: both stay unset
        # until the plan picks the default ring (`rules.layout_for`).
        try:
            if self.ring_attn_func is not None or self.sp_sharding is not None:
                self.ring_attn_func, self.sp_sharding = default_ring(
                    self.sequence_parallel_mode, self.tensor_parallel_size,
                    self.ring_attn_func, self.sp_sharding,
                    "heads_k_stride" in self.model_fields_set, self.attention_kernel)
        except LayoutError as err:
            raise ValueError(f"{err.message[:-1]}: {err.fix[:-1]}") from None
        return self

    @model_validator(mode="after")
    def _model_source(self) -> Config:
        if self.base_model is None and self.model_config_dict is None:
            raise ValueError(
                "set `base_model` (hub id or local path) or `model_config` "
                "(an inline config with `model_type`)"
            )
        if self.model_config_dict is not None and not isinstance(
            self.model_config_dict.get("model_type"), str
        ):
            raise ValueError("`model_config` needs a `model_type` key naming the family, e.g. "
                             "`model_type: llama`")
        if self.unfrozen_parameters is not None and self.adapter is not None:
            raise ValueError("`unfrozen_parameters` chooses what a full fine-tune trains; with "
                             "`adapter` only the adapter trains: drop one of them")
        for pattern in self.unfrozen_parameters or []:
            try:
                _, rows = unfrozen_pattern(pattern)
            except (re.error, ValueError) as e:
                raise ValueError(f"`unfrozen_parameters` entry {pattern!r} is not a pattern "
                                 f"({e})") from None
            if rows is not None and (self.fsdp or self.tensor_parallel_size > 1):
                raise ValueError(f"`unfrozen_parameters` entry {pattern!r} trains some rows "
                                 "of a parameter, which needs whole parameters on each rank: "
                                 "not with `fsdp` or `tensor_parallel_size` > 1")
        return self

    @property
    def row_tokens(self) -> int:
        """Tokens of the longest row a micro-batch runs: `micro_batch_size` packed rows of
        `sequence_len`; rl: grpo, its prompt groups (each prompt, at most `sequence_len -
        max_completion_length` tokens, once with `prefix_sharing`, then its completions)."""
        if self.rl != "grpo":
            return self.micro_batch_size * self.sequence_len
        g, new = self.trl.num_generations, self.trl.max_completion_length
        if not self.prefix_sharing:
            return self.micro_batch_size * self.sequence_len
        return self.micro_batch_size // g * (self.sequence_len - new + g * (new + 1))

    @property
    def source_dir(self) -> str | None:
        return self._source_dir

    @property
    def random_init(self) -> bool:
        """The weights are drawn from `seed`: an inline `model_config`, or `reinit_weights`."""
        return self.model_config_dict is not None or self.reinit_weights

    @property
    def preference_beta(self) -> float:
        """beta of the preference loss: `rl_beta` (or ORPO's `orpo_alpha`), else TRL's 0.1."""
        given = self.orpo_alpha if self.orpo_alpha is not None else self.rl_beta
        return given if given is not None else 0.1

    @property
    def precomputed_reference(self) -> bool:
        """dpo/ipo take the reference from log-probabilities computed before training (not
        the adapter switched off at every step): always without an adapter (a full
        fine-tune) or with a loaded one (switching it off would not give the initial model),
        and on request (`precompute_ref_log_probs`)."""
        return self.rl in ("dpo", "ipo") and (
            self.adapter is None or bool(self.lora_model_dir) or self.precompute_ref_log_probs)

    @property
    def prepared_path(self) -> str:
        return self.dataset_prepared_path or f"{self.output_dir.rstrip('/')}/prepared"

    @property
    def tokenizer_source(self) -> str | None:
        return self.tokenizer or self.base_model

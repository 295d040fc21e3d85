"""The GRPO section (`trl:`, for `rl: grpo`): TRL's GRPOConfig names, defaults and meaning,
the keys accepted and ignored or refused, the rules GRPO places on the rest of the run, and
the plan's GRPO rows."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from longctx_cli.config.sections.base import StrictModel
from longctx_cli.config.sections.data import DataSection, is_import_path
from longctx_cli.config.sections.model import chunked_attention
from longctx_cli.config.shape import ModelShape
from longctx_cli.errors import UserError
from longctx_cli.families import family

GrpoLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def is_reward_model(entry: str) -> bool:
    """A `trl.reward_funcs` entry that names a model (a folder path or a hub id: a `/` in
    it), not a `module.function`."""
    return "/" in entry or "\\" in entry


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


class TrlConfig(StrictModel):
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
            if not (is_import_path(name) or is_reward_model(name)):
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
        group per generation batch (default: the accumulation), a multiple of the
        accumulation: longctx splits one generation batch over whole optimizer steps.
        Raises ValueError (one paragraph naming the key) when `generation_batch_size` does
        not split evenly over the groups, UserError when the steps do not split so."""
        accumulation = gradient_accumulation_steps
        if self.steps_per_generation is not None:
            steps = self.steps_per_generation
        elif self.generation_batch_size is None:
            return accumulation
        else:
            per_micro_step = micro_batch_size * dp
            if self.generation_batch_size % per_micro_step:
                raise ValueError(
                    f"`trl.generation_batch_size: {self.generation_batch_size}` must be a "
                    f"multiple of micro_batch_size x data-parallel groups = {micro_batch_size} "
                    f"x {dp} = {per_micro_step} (every group rolls out micro_batch_size "
                    "completions per micro-batch); set it to a multiple of "
                    f"{per_micro_step}, or give `trl.steps_per_generation` instead")
            steps = self.generation_batch_size // per_micro_step
        if steps % accumulation:
            key = ("steps_per_generation" if self.steps_per_generation is not None
                   else "generation_batch_size")
            raise UserError(
                f"`trl.{key}: {getattr(self, key)}` makes {steps} micro-batches per "
                f"generation batch at {dp} data-parallel group(s), not a multiple of "
                f"`gradient_accumulation_steps: {accumulation}`: longctx splits one generation "
                "batch over whole optimizer steps (TRL would start a new one inside a step).",
                where=f"trl.{key}",
                fix=f"make it {accumulation} x k micro-batches per group (steps_per_generation "
                f"{accumulation}, {2 * accumulation}, ...), or lower "
                "gradient_accumulation_steps.")
        return steps


def check_grpo(trl: TrlConfig | None, data: DataSection, micro_batch_size: int, tp: int,
               other_keys: dict[str, Any], notes: list[tuple[str, str]]) -> None:
    """The rules of `rl: grpo` on the rest of the run (ValueError naming the keys);
    `other_keys`: the preference-loss keys as set (refused). Fills in what GRPO implies:
    prompt datasets, TRL's unshuffled sampler as `curriculum_sampling`; `notes` gets the
    `trl:` keys ignored."""
    if trl is None:
        raise ValueError("`rl: grpo` needs a `trl:` section with at least `reward_funcs` "
                         "(e.g. `trl: {reward_funcs: [rewards.passkey_digits], "
                         "num_generations: 4}`); see docs/rl.md")
    if not data.datasets or data.pretraining_dataset:
        raise ValueError("`rl: grpo` rolls out the prompts of `datasets` (`type: prompt`, "
                         "or an Axolotl transform `type: module.function`); add one")
    for entry in data.datasets:
        if "type" not in entry.model_fields_set:
            entry.type = "prompt"  # a GRPO dataset is a prompt dataset
        if entry.type != "prompt":
            raise ValueError(f"`rl: grpo` rolls out prompts, but a dataset has `type: "
                             f"{entry.type}`; use `type: prompt` (a `prompt` column: text "
                             "or chat messages) or an Axolotl transform "
                             "`type: module.function`")
    if data.eval_datasets or data.val_set_size:
        raise ValueError("held-out rollouts are not supported yet with `rl: grpo`: drop "
                         "`eval_datasets` / `val_set_size` (evaluate the saved model with "
                         "`longctx eval`)")
    if tp > 1:
        raise ValueError("`rl: grpo` with `tensor_parallel_size` > 1: the update would run "
                         "(TP-sp scores GRPO exactly, tests/test_grpo.py), but rollouts "
                         "cannot. TP-sp shards every activation along the sequence over "
                         "the TP group, and a decode step has one token per sequence; the "
                         "sampler also needs each token's whole-vocabulary logits, which "
                         "the vocab-parallel head splits. Decoding under TP is not "
                         "implemented. Use sequence (and data) parallelism, with FSDP for "
                         "memory (rollouts then gather the weights once)")
    for key, value in other_keys.items():
        if value is not None:
            raise ValueError(f"`{key}` is a preference-loss key; `rl: grpo` reads its "
                             f"settings from `trl:` (the KL weight is `trl.beta`): drop it")
    if micro_batch_size % trl.num_generations:
        raise ValueError(
            f"`micro_batch_size: {micro_batch_size}` counts completions (TRL's "
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
        for name, unit in (("micro_batch_size", micro_batch_size),
                           ("trl.num_generations", trl.num_generations)):
            if trl.generation_batch_size % unit:
                raise ValueError(
                    f"`trl.generation_batch_size: {trl.generation_batch_size}` must be a "
                    f"multiple of `{name}: {unit}` (a generation batch is micro_batch_size "
                    "completions per data-parallel group per micro-batch, whole prompt "
                    f"groups); set it to a multiple of {micro_batch_size} x the "
                    "data-parallel groups, or give `trl.steps_per_generation` instead")
    if tp > 1 and (trl.top_entropy_quantile < 1 or trl.entropy_coef):
        key = "top_entropy_quantile" if trl.top_entropy_quantile < 1 else "entropy_coef"
        raise ValueError(
            f"`trl.{key}: {getattr(trl, key)}` reads each token's entropy, which the "
            "vocab-parallel head under `tensor_parallel_size` > 1 does not compute; drop "
            f"`trl.{key}` or use sequence parallelism without TP")
    if not trl.shuffle_dataset:
        if "curriculum_sampling" in data.model_fields_set and not data.curriculum_sampling:
            raise ValueError("`trl.shuffle_dataset: false` and `curriculum_sampling: false` "
                             "disagree (shuffle the prompts or not); drop one of them")
        data.curriculum_sampling = True  # TRL's unshuffled sampler: the data's order
    if trl.max_completion_length >= data.sequence_len:
        raise ValueError(
            f"`trl.max_completion_length: {trl.max_completion_length}` leaves no room for "
            f"a prompt within `sequence_len: {data.sequence_len}` (prompt + completion); "
            "raise sequence_len or lower max_completion_length")
    notes.extend((f"trl.{key}", f"ignored: {why}") for key, why in trl._ignored)


def check_generation_batch(trl: TrlConfig, dp: int, micro_batch_size: int,
                           gradient_accumulation_steps: int) -> None:
    """The generation batch splits over `dp` data-parallel groups and whole optimizer steps
    (`TrlConfig.generation_steps`), as a UserError naming the key."""
    try:
        trl.generation_steps(dp, micro_batch_size, gradient_accumulation_steps)
    except ValueError as e:
        raise UserError(str(e), where="trl.generation_batch_size") from None


def check_grpo_router_aux_loss(trl: TrlConfig, shape: ModelShape) -> None:
    """`rl: grpo` on a mixture-of-experts model: at TRL's default (`router_aux_loss_coef`
    null) TRL adds the model's coefficient x the load-balancing loss to the GRPO loss for any
    model whose config has `output_router_logits`; longctx does not, so it asks for 0.0."""
    if trl.router_aux_loss_coef is not None:
        return
    coef = shape.config_value("router_aux_loss_coef")
    if shape.config_value("output_router_logits") is None or not coef:
        return
    raise UserError(
        f"`rl: grpo` on a mixture-of-experts model: TRL, at its default "
        f"(`router_aux_loss_coef` null), adds the model's coefficient ({coef}) x the router "
        "load-balancing loss to the GRPO loss; longctx trains the GRPO loss alone, so the "
        "run would differ from TRL's.",
        where="trl.router_aux_loss_coef",
        fix="set `trl.router_aux_loss_coef: 0.0` to train the GRPO loss alone (the routers "
        "still learn through it).",
    )


def rollout_decoding_note(trl: TrlConfig, shape: ModelShape) -> list[str]:
    """`rl: grpo` on a model whose decode steps cannot attend a cached, sharded prompt (a
    window or chunk, layers that mix tokens outside attention): what its rollouts cost."""
    why = ("its layers attend within a sliding window" if shape.sliding_window else
           "its layers attend within chunks" if chunked_attention(shape) else
           "some layers mix tokens outside attention" if family(shape.model_type).mixes_tokens
           else None)
    if why is None:
        return []
    n = trl.max_completion_length
    return [f"rollouts decode {shape.model_type} by one full SP forward per generated token "
            f"({why}; the cached decode keeps no window or scan state): a completion of up to "
            f"{n} tokens costs up to {n} forwards over the prompt and its completions instead "
            "of one prefill and cached steps, about that many times the prefill's time."]


def grpo_text(trl: TrlConfig, frozen_reference: bool, prefix_sharing: bool) -> str:
    """The plan's objective row of a GRPO run; `frozen_reference`: the KL's reference is a
    frozen copy of the initial model (a full fine-tune, or a continued adapter)."""
    text = (f"grpo ({trl.loss_type}, {trl.importance_sampling_level}-level ratios, epsilon "
            f"{trl.epsilon:g}/{trl.epsilon_upper:g}); {trl.num_generations} completions of up "
            f"to {trl.max_completion_length} tokens per prompt, sampled under SP from one "
            f"prefill (temperature {trl.temperature:g}); rewards: "
            f"{', '.join(trl.reward_funcs)}")
    if trl.num_iterations > 1:
        text += (f"; {trl.num_iterations} steps per generation batch (rollout-time "
                 "log-probabilities: one no-grad pass)")
    if trl.beta:
        text += (f"; KL to the reference, beta {trl.beta:g}: " + (
            "a frozen copy of the initial model (one more model in memory), one no-grad "
            "pass per micro-batch" if frozen_reference else "the base model with the adapter "
            "off, one no-grad pass per micro-batch, no copy"))
    text += ("; each prompt once in its group's row (prefix_sharing)" if prefix_sharing
             else "; each completion after its own prompt copy (prefix_sharing: false)")
    return text

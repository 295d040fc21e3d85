"""The objective section: what the run minimises. The causal-LM loss by default; `rl:` a
preference loss (dpo, ipo, simpo, orpo) on preference pairs, KTO on unpaired labelled
completions, or GRPO (its settings are the `trl:` section, sections/grpo.py); `reward_model:`
a reward model's pairwise loss on preference pairs. Its rules across the data, and the plan's
objective row."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import AliasChoices, Field, field_validator

from longctx_cli.config.sections.base import Section
from longctx_cli.config.sections.data import (
    KTO_TYPES,
    PREFERENCE_TYPES,
    DataSection,
    is_preference_type,
)
from longctx_cli.config.sections.grpo import TrlConfig, grpo_text
from longctx_cli.config.sections.model import chunked_attention
from longctx_cli.config.shape import ModelShape
from longctx_cli.errors import UserError

RlMethod = Literal["dpo", "ipo", "simpo", "orpo", "kto", "grpo"]
DpoLossType = Literal["sigmoid", "hinge", "ipo", "robust"]


class ObjectiveSection(Section):
    title = "preference optimisation"

    rl: RlMethod | None = Field(
        None,
        description="Train on preference pairs instead of the causal-LM loss: dpo (with "
        "`dpo_loss_type`), ipo (dpo with the ipo loss), simpo (no reference model), orpo (NLL "
        "of the chosen sequences plus an odds-ratio term; no reference model); these need "
        "preference datasets (docs/preference.md). kto: TRL's KTO loss on completions "
        "labelled desirable or not (Axolotl's KTO types; docs/preference.md). grpo: online "
        "RL on prompt datasets, completions sampled under SP and scored by the "
        "`trl.reward_funcs` (docs/rl.md).",
    )
    rl_beta: float | None = Field(
        None, gt=0, validation_alias=AliasChoices("rl_beta", "dpo_beta"),
        description="beta: how far the policy may move from the reference (dpo, ipo: the "
        "regularisation tau); kto: TRL's KTO beta; simpo: the reward scale; orpo: the "
        "odds-ratio term's weight, also set by `orpo_alpha` (default 0.1, TRL's).",
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

    kto_desirable_weight: float | None = Field(
        None, gt=0, description="kto: the weight of a desirable example's loss (TRL's "
        "`desirable_weight`, default 1).",
    )
    kto_undesirable_weight: float | None = Field(
        None, gt=0, description="kto: the weight of an undesirable example's loss (TRL's "
        "`undesirable_weight`, default 1).",
    )
    reward_model: bool = Field(
        False, description="Train a reward model on preference pairs instead of the "
        "causal-LM loss, as TRL's RewardTrainer does: the model loads as "
        "AutoModelForSequenceClassification with one label (a new `score` head), each "
        "sequence is scored at its last token that is not padding, and the loss is "
        "-logsigmoid(r_chosen - r_rejected) (mean over pairs). Needs preference datasets; "
        "checkpoints load with AutoModelForSequenceClassification (docs/preference.md).",
    )
    center_rewards_coefficient: float | None = Field(
        None, description="reward_model: adds this times (r_chosen + r_rejected)^2 to each "
        "pair's loss, which keeps the rewards centred on 0 (TRL's RewardConfig option; "
        "default none).",
    )

    @field_validator("rl", mode="before")
    @classmethod
    def _rl_method(cls, value: Any) -> Any:
        if value is None or value in get_args(RlMethod):
            return value
        why = "it is an online method (it generates while it trains), which longctx does not run"
        raise ValueError(f"`rl: {value}` cannot run: {why}; longctx trains "
                         f"{', '.join(get_args(RlMethod))}")

    @field_validator("dpo_loss_type", mode="before")
    @classmethod
    def _loss_type_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def preference(self) -> bool:
        """A preference loss on pairs (not KTO, not GRPO, not the causal-LM loss)."""
        return self.rl is not None and self.rl not in ("kto", "grpo")

    @property
    def whole_rows(self) -> bool:
        """Each dataset row is one input row of the model's own training (the causal-LM
        loss); pairs, KTO examples and GRPO groups are split into several rows there."""
        return self.splits_rows is None

    @property
    def splits_rows(self) -> str | None:
        """The setting that splits a dataset row into several rows of the model's own
        training (``rl: dpo``, ``reward_model: true``); None for the causal-LM loss."""
        if self.rl is not None:
            return f"rl: {self.rl}"
        return "reward_model: true" if self.reward_model else None

    @property
    def preference_beta(self) -> float:
        """beta of the preference loss: `rl_beta` (or ORPO's `orpo_alpha`), else TRL's 0.1."""
        given = self.orpo_alpha if self.orpo_alpha is not None else self.rl_beta
        return given if given is not None else 0.1

    def precomputed_reference(self, adapter: str | None, continued: bool) -> bool:
        """dpo/ipo take the reference from log-probabilities computed before training (not
        the adapter switched off at every step): always without an adapter (a full
        fine-tune) or with a loaded one (`continued`: switching it off would not give the
        initial model), and on request (`precompute_ref_log_probs`)."""
        return self.rl in ("dpo", "ipo") and (
            adapter is None or continued or self.precompute_ref_log_probs)


# The keys of the DPO family that KTO does not read.
_NOT_KTO = ("orpo_alpha", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing",
            "simpo_gamma", "cpo_alpha", "prefix_sharing", "precompute_ref_log_probs")


def check_kto(objective: ObjectiveSection, data: DataSection, micro_batch_size: int,
              adapter: str | None, continued: bool) -> None:
    """The rules of `rl: kto` (and of its keys without it); raises ValueError naming the keys.
    `continued`: the adapter is loaded (`lora_model_dir`)."""
    weights = [k for k in ("kto_desirable_weight", "kto_undesirable_weight")
               if getattr(objective, k) is not None]
    if objective.rl != "kto":
        if weights:
            raise ValueError(f"`{weights[0]}` weighs KTO's loss; `rl: {objective.rl}` does not "
                             "read it: drop it, or set `rl: kto`")
        return
    given = [k for k in _NOT_KTO if k in objective.model_fields_set]
    if given:
        raise ValueError(f"`{given[0]}` is a setting of the DPO family, which `rl: kto` does "
                         "not read: drop it")
    others = [e.type for e in data.entries if e.type not in KTO_TYPES]
    if others or not data.datasets:
        raise ValueError(f"`rl: kto` trains on labelled completions, but a dataset has "
                         f"`type: {others[0] if others else '(none)'}`; use a KTO type "
                         f"({', '.join(KTO_TYPES)})")
    if data.pretraining_dataset:
        raise ValueError("`rl: kto` trains on labelled completions, not a "
                         "`pretraining_dataset`")
    if data.eval_datasets or data.val_set_size:
        raise ValueError("`rl: kto` has no evaluation yet (TRL's KTO eval metrics are not "
                         "computed): drop `eval_datasets` and `val_set_size`")
    if "sample_packing" in data.model_fields_set and data.sample_packing:
        raise ValueError("`sample_packing: true` with `rl: kto`: each KTO example is a row of "
                         "its own (its KL sequence belongs to its micro-batch), as in Axolotl, "
                         "which refuses packing with kto; set `sample_packing: false`")
    if data.excess_length_strategy == "truncate":
        raise ValueError("`excess_length_strategy: truncate` would cut a KTO example's "
                         "completion off; with `rl: kto` a micro-batch of examples with one "
                         "longer than sequence_len is dropped and counted (`drop`)")
    if micro_batch_size < 2:
        raise ValueError(f"`micro_batch_size: {micro_batch_size}` with `rl: kto`: KTO's KL "
                         "reference point pairs each prompt with another example's completion "
                         "of the micro-batch (TRL refuses a batch of 1); set it to 2 or more")
    if adapter is None or continued:
        raise ValueError("`rl: kto` takes its reference from the base model with a new "
                         "adapter switched off; a full fine-tune or a loaded adapter "
                         "(`lora_model_dir`) would need a reference copy, which KTO does not "
                         "have yet: set `adapter: lora` (or qlora) without `lora_model_dir`")


def check_preference(objective: ObjectiveSection, data: DataSection) -> None:
    """The rules of the objective and the data together, for the DPO family and the
    causal-LM loss (GRPO: sections/grpo.py; KTO: `check_kto`); raises ValueError naming the
    keys."""
    entries = data.entries
    prompts = [e for e in entries if e.type == "prompt"]
    if prompts:
        what = (f"`type: {prompts[0].transform}` (a Python transform)" if
                prompts[0].transform else "`type: prompt`")
        raise ValueError(f"{what} holds prompts to roll out, which train with `rl: grpo`; "
                         "set `rl: grpo` (and its `trl:` section), or use an SFT type")
    pairs = [e.type for e in entries if is_preference_type(e.type)]
    if objective.center_rewards_coefficient is not None and not objective.reward_model:
        raise ValueError(f"`center_rewards_coefficient: {objective.center_rewards_coefficient}` "
                         "centres a reward model's rewards; set `reward_model: true`, or drop "
                         "it")
    if objective.reward_model:
        _check_reward_model(objective, data)
        return
    if objective.rl is None and objective.prefix_sharing:
        raise ValueError("`prefix_sharing: true` shares a preference pair's prompt between "
                         "its answers; set `rl` (dpo, ipo or simpo), or drop it")
    if objective.rl is None:
        if pairs:
            raise ValueError(f"`type: {pairs[0]}` holds preference pairs, which train with "
                             "`rl:` (dpo, ipo, simpo or orpo); set `rl`, or use an SFT type")
        return
    others = [e.type for e in entries if not is_preference_type(e.type)]
    if others or not data.datasets:
        raise ValueError(f"`rl: {objective.rl}` trains on preference pairs, but a dataset has "
                         f"`type: {others[0] if others else '(none)'}`; use a preference type "
                         f"({', '.join(PREFERENCE_TYPES)})")
    if data.pretraining_dataset:
        raise ValueError("`rl` trains on preference pairs, not a `pretraining_dataset`")
    if data.excess_length_strategy == "truncate":
        raise ValueError("`excess_length_strategy: truncate` would cut a pair's answers off; "
                         "with `rl` pairs longer than sequence_len are dropped and counted "
                         "(`drop`, the default)")
    _check_losses(objective)


# The keys of the preference losses (`rl`), which a reward model does not read.
_RL_KEYS = ("rl_beta", "orpo_alpha", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing",
            "simpo_gamma", "cpo_alpha", "prefix_sharing", "precompute_ref_log_probs")


def _check_reward_model(objective: ObjectiveSection, data: DataSection) -> None:
    """`reward_model: true`: preference pairs, no `rl` nor its keys, no eval data yet."""
    if objective.rl is not None:
        raise ValueError(f"`reward_model: true` trains a reward model, `rl: {objective.rl}` a "
                         "policy on the same pairs; keep one of them")
    fields = type(objective).model_fields
    given = [key for key in _RL_KEYS if getattr(objective, key) != fields[key].default]
    if given:
        raise ValueError(f"`{given[0]}` is a key of `rl`, which a reward model (`reward_model: "
                         "true`) does not read: drop it")
    others = [e.type for e in data.entries if not is_preference_type(e.type)]
    if others or not data.datasets:
        raise ValueError(f"`reward_model: true` trains on preference pairs, but a dataset has "
                         f"`type: {others[0] if others else '(none)'}`; use a preference type "
                         f"({', '.join(PREFERENCE_TYPES)})")
    if data.pretraining_dataset:
        raise ValueError("`reward_model: true` trains on preference pairs, not a "
                         "`pretraining_dataset`")
    if data.excess_length_strategy == "truncate":
        raise ValueError("`excess_length_strategy: truncate` would cut a pair's answers off; "
                         "with `reward_model: true` pairs longer than sequence_len are dropped "
                         "and counted (`drop`, the default)")
    if data.eval_datasets or data.val_set_size:
        raise ValueError("eval data (`eval_datasets`, `val_set_size`) is not supported with "
                         "`reward_model: true` yet: drop it (or set `val_set_size: 0`)")


def _check_losses(objective: ObjectiveSection) -> None:
    """The loss keys of a preference method; fills in `dpo_loss_type`'s default."""
    rl = objective.rl
    if objective.prefix_sharing and rl == "orpo":
        raise ValueError("`prefix_sharing: true` with `rl: orpo`: ORPO tokenizes each "
                         "answer's prompt on its own (the two may differ in their last "
                         "token), and sharing is not implemented for that; drop one of "
                         "them")
    if objective.orpo_alpha is not None and rl != "orpo":
        raise ValueError(f"`orpo_alpha: {objective.orpo_alpha}` weighs ORPO's odds-ratio term; "
                         f"`rl: {rl}` does not read it: drop it, or set `rl: orpo`")
    losses = objective.dpo_loss_type
    if rl == "orpo":
        if losses is not None:
            raise ValueError("`dpo_loss_type` chooses a dpo loss; `rl: orpo` has its own: "
                             "drop it")
        if (objective.orpo_alpha is not None and objective.rl_beta is not None
                and objective.orpo_alpha != objective.rl_beta):
            raise ValueError(f"`orpo_alpha: {objective.orpo_alpha}` and `rl_beta: "
                             f"{objective.rl_beta}` both set ORPO's beta; keep one")
        if objective.dpo_label_smoothing:
            raise ValueError(f"`dpo_label_smoothing: {objective.dpo_label_smoothing}` is not "
                             "read by ORPO (TRL's ORPOTrainer has no label smoothing): drop "
                             "it")
        if objective.precompute_ref_log_probs:
            raise ValueError("`precompute_ref_log_probs: true`: ORPO has no reference "
                             "model; drop it")
    elif rl == "ipo":
        if losses not in (None, ["ipo"]):
            raise ValueError(f"`rl: ipo` is dpo with the ipo loss; `dpo_loss_type: "
                             f"{losses}` contradicts it: drop it, or use `rl: dpo`")
        losses = ["ipo"]
    elif rl == "simpo":
        if losses is not None:
            raise ValueError("`dpo_loss_type` chooses a dpo loss; `rl: simpo` has its own: "
                             "drop it")
        if objective.cpo_alpha:
            raise ValueError(f"`cpo_alpha: {objective.cpo_alpha}` adds an NLL term over the "
                             "chosen prompt and answer, which longctx does not compute yet; "
                             "set it to 0 (SimPO as published)")
    else:
        losses = losses or ["sigmoid"]
    if losses and objective.dpo_loss_weights is not None and (
            len(objective.dpo_loss_weights) != len(losses)):
        raise ValueError(f"`dpo_loss_weights` has {len(objective.dpo_loss_weights)} weights "
                         f"for {len(losses)} loss types; give one per `dpo_loss_type`")
    if objective.dpo_label_smoothing and losses and "robust" not in losses:
        raise ValueError(f"`dpo_label_smoothing: {objective.dpo_label_smoothing}` is read only "
                         f"by the robust loss (TRL ignores it for {', '.join(losses)}); set "
                         "`dpo_loss_type: robust`, or drop it")
    objective.dpo_loss_type = losses


def check_prefix_sharing(objective: ObjectiveSection, shape: ModelShape) -> None:
    """Shared pair prompts are a second, fully visible key range per branch document, which
    every strategy and kernel computes (flash-attn's rows on PyTorch's flash op); a window
    or a chunk would clip it."""
    if not objective.prefix_sharing:
        return
    why = ("the model's sliding-window attention" if shape.sliding_window else
           "the model's chunked local attention" if chunked_attention(shape) else None)
    if why:
        raise UserError(f"`prefix_sharing: true` cannot run with {why}: a shared prompt is a "
                        "key range every answer token sees whole, which a window or a chunk "
                        "would cut.", where="prefix_sharing",
                        fix="set `prefix_sharing: false` for this model.")


def objective_text(objective: ObjectiveSection, trl: TrlConfig | None, adapter: str | None,
                   continued: bool) -> str:
    """What the run minimises, and for a preference run where its reference comes from.
    `adapter`, `continued`: the run's adapter, and whether it continues a saved one."""
    if objective.reward_model:
        centred = objective.center_rewards_coefficient
        return ("reward model: -logsigmoid(r_chosen - r_rejected)"
                + (f" + {centred:g} x (r_chosen + r_rejected)^2" if centred is not None else "")
                + " (mean over pairs), each sequence's reward the one-label `score` head at "
                "its last token")
    if objective.rl is None:
        return "causal-LM loss (mean over target tokens)"
    if objective.rl == "kto":
        return _kto_text(objective)
    if objective.rl == "grpo":
        assert trl is not None
        return grpo_text(trl, frozen_reference=adapter is None or continued,
                         prefix_sharing=objective.prefix_sharing)
    text = _preference_text(objective, objective.precomputed_reference(adapter, continued))
    if objective.prefix_sharing:
        text += "; each pair's prompt once in the row (prefix_sharing)"
    return text


def _kto_text(objective: ObjectiveSection) -> str:
    weights = [objective.kto_desirable_weight or 1.0, objective.kto_undesirable_weight or 1.0]
    return (f"kto, beta {objective.preference_beta:g}, desirable x{weights[0]:g}, undesirable "
            f"x{weights[1]:g} (mean over examples); KL reference point: each micro-batch's "
            "prompts with its completions rotated by one (TRL's); reference: the base model "
            "with the adapter off")


def _preference_text(objective: ObjectiveSection, precomputed: bool) -> str:
    beta = objective.preference_beta
    if objective.rl == "orpo":
        return (f"orpo, beta {beta:g}: NLL of the chosen sequences (mean over their targets, "
                "prompt included) minus beta x log-sigmoid of the log odds ratio (mean over "
                "pairs); no reference model")
    if objective.rl == "simpo":
        return (f"simpo, beta {beta:g}, gamma {objective.simpo_gamma:g} (mean over pairs); "
                "no reference model")
    losses = " + ".join(objective.dpo_loss_type or ["sigmoid"])
    reference = ("every pair's log-probabilities under the initial weights, one no-grad SP "
                 "pass over the rows before training (kept in output_dir)"
                 if precomputed else "the base model with the adapter off, "
                 "one extra no-grad forward per micro-batch, no copy")
    return (f"{objective.rl} ({losses}), beta {beta:g} (mean over pairs); reference: "
            f"{reference}")

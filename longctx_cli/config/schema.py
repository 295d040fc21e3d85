"""The YAML schema: `Config`, every key a user can write, composed of one section per
concern (config/sections/: model, vision, data, parallel, training, memory, adapter,
objective, GRPO's `trl`, evaluation, output, run).

The YAML stays flat: `Config` hands each top-level key to the section that owns it, and each
section's validators see only its own keys. The rules that span sections are here, each a
function of the sections it reads. `docs/config.md` is generated from the sections
(`python -m longctx_cli.config.docs`), and key names follow Axolotl's where the idea is the
same.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, model_validator
from pydantic.fields import FieldInfo

from longctx_cli.config.sections.adapter import AdapterSection
from longctx_cli.config.sections.base import Section, StrictModel
from longctx_cli.config.sections.data import DataSection, DatasetConfig, check_streamed
from longctx_cli.config.sections.evaluation import EvalSection
from longctx_cli.config.sections.grpo import TrlConfig, check_grpo
from longctx_cli.config.sections.memory import MemorySection
from longctx_cli.config.sections.model import ModelSection, check_mistral_common
from longctx_cli.config.sections.objective import (
    ObjectiveSection,
    check_kto,
    check_preference,
)
from longctx_cli.config.sections.output import OutputSection
from longctx_cli.config.sections.parallel import ParallelSection, fold_sharding
from longctx_cli.config.sections.run import RunSection
from longctx_cli.config.sections.training import (
    PEFT_PREFIX,
    TrainingSection,
    misses_adapter_names,
)
from longctx_cli.config.sections.vision import VisionSection

__all__ = ["Config", "DatasetConfig", "SECTIONS"]

# Each section's attribute on `Config`, in the order docs/config.md lists them.
SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "vision": VisionSection,
    "data": DataSection,
    "parallel": ParallelSection,
    "training": TrainingSection,
    "memory": MemorySection,
    "lora": AdapterSection,
    "objective": ObjectiveSection,
    "eval": EvalSection,
    "output": OutputSection,
    "run": RunSection,
}


def _keys_of(section: type[Section]) -> dict[str, str]:
    """{every key a section accepts (aliases included): its field name}."""
    keys = {}
    for name, info in section.model_fields.items():
        keys[info.alias or name] = name
        keys[name] = name
        for choice in getattr(info.validation_alias, "choices", None) or []:
            if isinstance(choice, str):
                keys[choice] = name
    return keys


# {YAML key: (section, field name)} for every key a section owns.
KEY_SECTION: dict[str, tuple[str, str]] = {
    key: (section, name)
    for section, cls in SECTIONS.items() for key, name in _keys_of(cls).items()
}


class Config(StrictModel):
    """A longctx run: its sections, from one flat YAML mapping."""

    model: ModelSection
    vision: VisionSection
    data: DataSection
    parallel: ParallelSection
    training: TrainingSection
    memory: MemorySection
    lora: AdapterSection
    objective: ObjectiveSection
    trl: TrlConfig | None = Field(
        None, description="rl: grpo: the GRPO settings, under TRL's and Axolotl's names "
        "(`reward_funcs`, `num_generations`, `max_completion_length`, `beta`, `loss_type`, "
        "...). See docs/rl.md.",
    )
    eval: EvalSection
    output: OutputSection
    run: RunSection

    # (key, how it was handled) for every Axolotl key the loader mapped or ignored, and the
    # DeepSpeed mapping; the plan prints them.
    _axolotl_notes: list[tuple[str, str]] = PrivateAttr(default_factory=list)
    # The folder of the config file (set by `load_config`): reward functions and dataset
    # transforms (`module.function`) are imported from it first.
    _source_dir: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _into_sections(cls, data: Any) -> Any:
        """The flat mapping a user writes, split by section (a key no section owns stays at
        the top level, where it is an unknown key)."""
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {name: {} for name in SECTIONS}
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, (dict, Section)):
                out[key] = value  # an already split config (model_copy, tests)
            elif key in KEY_SECTION:
                out[KEY_SECTION[key][0]][key] = value
            else:
                out[key] = value
        return out

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        """The rules that read more than one section, in the order a user meets them."""
        objective, data = self.objective, self.data
        if self.trl is not None and objective.rl != "grpo":
            raise ValueError("`trl:` holds the settings of `rl: grpo`; set `rl: grpo`, or drop "
                             "the section")
        check_kto(objective, data, self.training.micro_batch_size, self.lora.adapter,
                  bool(self.lora.lora_model_dir))  # and its keys without `rl: kto`
        if objective.rl == "grpo":
            check_grpo(self.trl, data, self.training.micro_batch_size,
                       self.parallel.tensor_parallel_size,
                       {key: getattr(objective, key)
                        for key in ("rl_beta", "orpo_alpha", "dpo_loss_type")},
                       self._axolotl_notes)
            if "prefix_sharing" not in objective.model_fields_set:
                objective.prefix_sharing = True  # the long prompt once per group, unless asked
        elif objective.rl != "kto":
            check_preference(objective, data)
        if objective.reward_model:  # what the classifier's path does not build yet
            refused = ("tensor_parallel_size > 1" if self.parallel.tensor_parallel_size > 1
                       else "processor_type (a vision-language run)" if self.trains_images
                       else "merge_lora: true" if self.output.merge_lora else None)
            if refused:
                raise ValueError(f"`reward_model: true` with `{refused}` is not supported "
                                 "yet: drop one of them")
        check_streamed(data, self.training.max_steps)
        check_mistral_common(self.model, data, objective.rl, self.trains_images)
        if data.dataset_exact_deduplication and (self.vision.processor_type
                                                 or objective.rl == "grpo"):
            # Records are compared where text datasets (and preference pairs) are tokenized;
            # these paths read theirs elsewhere (image records, GRPO's prompts).
            what = "`processor_type` (a vision run)" if self.vision.processor_type else \
                "`rl: grpo`"
            raise ValueError(f"`dataset_exact_deduplication` is not done with {what}: its "
                             "records are read by another path; drop the key")
        if fold_sharding(self.parallel, self._axolotl_notes):
            self.memory.gradient_checkpointing = True  # fsdp_config.activation_checkpointing
        if self.training.early_stopping_patience is not None and not self.eval.scheduled:
            raise ValueError("`early_stopping_patience` needs evaluations: set `eval_steps`, "
                             "`evals_per_epoch` or `eval_strategy: epoch`")
        if self.lora.adapter is not None and self.model.tokens and not (
                self.lora.lora_modules_to_save):
            raise ValueError("`tokens` adds rows to the embeddings and lm_head, which with "
                             "`adapter` train only as modules peft saves whole: set "
                             "`lora_modules_to_save: [embed_tokens, lm_head]` (the model's "
                             "names for them), as Axolotl requires")
        missed = [p for p in self.training.unfrozen_parameters or []
                  if self.lora.adapter is not None and misses_adapter_names(p)]
        if missed:
            every = len(missed) == len(self.training.unfrozen_parameters or [])
            raise ValueError(
                f"`unfrozen_parameters` {missed} with `adapter`: Axolotl matches these "
                f"patterns against the adapter-wrapped model, whose parameter names all start "
                f"with `{PEFT_PREFIX}`, and freezes every parameter they do not match, the "
                "adapter's own included; " + (
                    "these match none, so nothing would train (Axolotl trains nothing: it "
                    "warns that all parameters are frozen)" if every else
                    "these can match none of them") + "; drop one of them: without "
                "`unfrozen_parameters` the adapter trains; without `adapter` the patterns "
                "choose what a full fine-tune trains; or write patterns for the wrapped names "
                f"(`{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.default.weight`)")
        rows = self.training.trains_rows_of_parameters
        if rows is not None and (self.parallel.fsdp or self.parallel.tensor_parallel_size > 1):
            raise ValueError(f"`unfrozen_parameters` entry {rows!r} trains some rows "
                             "of a parameter, which needs whole parameters on each rank: "
                             "not with `fsdp` or `tensor_parallel_size` > 1")
        return self

    # ---- the flat view: what the YAML and the outputs speak ----------------------------------

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """{field name: its FieldInfo} of every top-level key, section by section."""
        fields = {name: info for section in SECTIONS.values()
                  for name, info in section.model_fields.items()}
        fields["trl"] = cls.model_fields["trl"]
        return fields

    def flat_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The config as one flat mapping, as a user writes it (`model_dump`'s arguments)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(getattr(self, name).model_dump(**kwargs))
        out["trl"] = self.trl.model_dump(**kwargs) if self.trl is not None else None
        return out

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Config:
        """A copy with some top-level keys replaced (flat names, as in the YAML), not
        validated again (pydantic's `model_copy`)."""
        if not update:
            return super().model_copy(deep=deep)
        by_section: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for key, value in update.items():
            if key in KEY_SECTION:
                section, name = KEY_SECTION[key]
                by_section.setdefault(section, {})[name] = value
            else:
                top[key] = value
        for section, values in by_section.items():
            top[section] = getattr(self, section).model_copy(update=values, deep=deep)
        return super().model_copy(update=top, deep=deep)

    # ---- what spans sections ----------------------------------------------------------------

    @property
    def axolotl_notes(self) -> list[tuple[str, str]]:
        return self._axolotl_notes

    @property
    def source_dir(self) -> str | None:
        return self._source_dir

    @property
    def trains_images(self) -> bool:
        return self.vision.trains_images

    @property
    def row_tokens(self) -> int:
        """Tokens of the longest row a micro-batch runs: `micro_batch_size` packed rows of
        `sequence_len`; rl: grpo, its prompt groups (each prompt, at most `sequence_len -
        max_completion_length` tokens, once with `prefix_sharing`, then its completions)."""
        micro, length = self.training.micro_batch_size, self.data.sequence_len
        if self.objective.rl != "grpo" or not self.objective.prefix_sharing:
            return micro * length
        g, new = self.trl.num_generations, self.trl.max_completion_length
        return micro // g * (length - new + g * (new + 1))

    def generation_steps(self, dp: int) -> int:
        """`rl: grpo`: micro-batches of each of `dp` data-parallel groups in one generation
        batch (`TrlConfig.generation_steps`)."""
        training = self.training
        return self.trl.generation_steps(dp, training.micro_batch_size,
                                         training.gradient_accumulation_steps)

    @property
    def precomputed_reference(self) -> bool:
        """dpo/ipo take the reference from log-probabilities computed before training (see
        `ObjectiveSection.precomputed_reference`)."""
        return self.objective.precomputed_reference(self.lora.adapter,
                                                    bool(self.lora.lora_model_dir))

    @property
    def prepared_path(self) -> str:
        return (self.data.dataset_prepared_path
                or f"{self.output.output_dir.rstrip('/')}/prepared")

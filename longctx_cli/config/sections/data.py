"""The data section: the training and evaluation data, and how rows are built from it
(dataset entries, packing, lengths, chat templates)."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import AliasChoices, Field, field_validator, model_validator

from longctx_cli.config.sections.base import Section, StrictModel

DatasetType = Literal[
    "completion", "chat_template", "pretrain", "passkey", "input_output",
    "alpaca", "alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca_chat", "alpaca_instruct",
    "alpaca_instruct.load_no_prompt", "alpaca_w_system", "alpaca_w_system.load_instruct",
    "alpaca_w_system.load_chat",
    # preference pairs (with `rl:`), see data/preference.py
    "preference", "chat_template.default", "chat_template.argilla", "chatml.intel",
    "chatml.icr", "chatml.prompt_pairs", "chatml.argilla", "chatml.ultra", "chatml.argilla_chat",
    "llama3.intel", "llama3.icr", "llama3.prompt_pairs", "llama3.argilla", "llama3.ultra",
    "llama3.argilla_chat", "bradley_terry.chat_template",
    # prompts to roll out (with `rl: grpo`), see data/prompts.py
    "prompt",
]
PREFERENCE_TYPES = get_args(DatasetType)[
    get_args(DatasetType).index("preference"):get_args(DatasetType).index("prompt")]
# Axolotl's KTO types (`rl: kto`): the names of preference types whose records hold one
# labelled completion instead of a pair (data/kto.py renders them).
KTO_TYPES = tuple(f"{style}.{kind}" for style in ("chatml", "llama3")
                  for kind in ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra"))
# The types rendered with the config's (or the entry's) `chat_template`.
RENDERED_WITH_TEMPLATE = ("chat_template", "chat_template.default", "chat_template.argilla",
                          "bradley_terry.chat_template")


# The chat templates longctx ships (data/chat_templates.py holds their text).
SHIPPED_CHAT_TEMPLATES = (
    "chatml", "llama3", "qwen3", "gemma3", "phi_3", "qwen_25", "qwen2_vl", "qwen3_5",
    "falcon_h1", "llama4", "llama3_2_vision", "gemma", "gemma3n", "gemma4", "gemma4_unified",
    "cohere", "deepseek_v2", "jamba", "llava", "pixtral")
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


TrainOnEos = Literal["turn", "last", "all", "none"]
# The types whose conversations `drop_system_message` applies to (Axolotl's chat_template
# strategies).
_SYSTEM_TURN_TYPES = ("chat_template", "bradley_terry.chat_template")


class DatasetConfig(StrictModel):
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
    drop_system_message: bool = Field(
        False,
        description="chat_template, bradley_terry.chat_template: leave out a conversation's "
        "first turn when it is a system turn (as Axolotl does); a template's own default "
        "system message stays.",
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
                data["type"] not in get_args(DatasetType)) and is_import_path(data["type"]):
            data = {**data, "type": "prompt", "transform": data["type"]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        if self.shards is not None and self.shards_idx >= self.shards:
            raise ValueError(f"`shards_idx` {self.shards_idx} must be below `shards` "
                             f"({self.shards})")
        if self.drop_system_message and self.type not in _SYSTEM_TURN_TYPES:
            raise ValueError(f"`drop_system_message` is read by the types "
                             f"{', '.join(_SYSTEM_TURN_TYPES)} only, not `{self.type}`: "
                             "drop it, or remove the system text from your data")
        if self.path is None and self.data_files is None and self.type != "passkey":
            raise ValueError(f"a `{self.type}` dataset needs a `path` or `data_files`")
        return self


def is_import_path(value: str) -> bool:
    """`module.function` (dotted Python names, at least one dot)."""
    return bool(re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value))


def as_entries(value: Any) -> Any:
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


class DataSection(Section):
    title = "data"

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
        "tokenizer's own), one shipped with longctx (chatml, llama3, qwen3, gemma3, phi_3, "
        "qwen_25, qwen2_vl, qwen3_5, falcon_h1, llama4, llama3_2_vision, gemma, gemma3n, "
        "gemma4, gemma4_unified, cohere, deepseek_v2, jamba, llava, pixtral), jinja "
        "(`chat_template_jinja`), or tokenizer_default_fallback_<name>.",
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
    dataset_exact_deduplication: bool = Field(
        False, description="Drop every record identical to an earlier one of the same split "
        "(all its fields, across the split's datasets) before tokenizing; the preprocess "
        "report counts them per dataset. Not with `processor_type`, `rl: grpo` or "
        "`pretraining_dataset`."
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

    @field_validator("pretraining_dataset", mode="before")
    @classmethod
    def _pretraining_entries(cls, value: Any) -> Any:
        return as_entries(value)

    @model_validator(mode="after")
    def _deduplicated_data(self) -> DataSection:
        if self.dataset_exact_deduplication and self.pretraining_dataset:
            raise ValueError("`dataset_exact_deduplication` cannot compare the records of a "
                             "streamed `pretraining_dataset` (they are never all read "
                             "before training); drop one of them")
        return self

    @model_validator(mode="after")
    def _chat_template_names(self) -> DataSection:
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

    @property
    def entries(self) -> list[DatasetConfig]:
        """Every training and held-out dataset entry."""
        return [*self.datasets, *self.eval_datasets]


def check_streamed(data: DataSection, max_steps: int | None) -> None:
    """A `pretraining_dataset` run: streamed text, with a known number of steps."""
    if not data.pretraining_dataset:
        return
    if any(e.type != "pretrain" for e in data.pretraining_dataset):
        raise ValueError("`pretraining_dataset` entries must be `type: pretrain`")
    if data.streaming is False:
        raise ValueError("`pretraining_dataset` is always streamed; drop `streaming: false` "
                         "or list the files under `datasets` with `type: pretrain`")
    if max_steps is None:
        raise ValueError("`pretraining_dataset` is streamed, so its length is unknown: "
                         "set `max_steps`")
    if data.datasets:
        raise ValueError("use either `datasets` or `pretraining_dataset`, not both")
    if data.eval_datasets or data.val_set_size:
        # Not silently ignored: a streamed run has no prepared eval rows yet.
        raise ValueError("eval data (`eval_datasets`, `val_set_size`) is not supported "
                         "with `pretraining_dataset` yet")

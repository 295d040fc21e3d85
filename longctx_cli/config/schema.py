"""The YAML schema: every key a user can write, with its type, default and meaning.

This module is the single source of truth for the config. `docs/config.md` is generated
from it (`python -m longctx_cli.config.docs`), and key names follow Axolotl's where the idea
is the same.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)


DatasetType = Literal[
    "completion", "chat_template", "pretrain", "passkey", "input_output",
    "alpaca", "alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca_chat", "alpaca_instruct",
    "alpaca_instruct.load_no_prompt", "alpaca_w_system", "alpaca_w_system.load_instruct",
    "alpaca_w_system.load_chat",
]
TrainOnEos = Literal["turn", "last", "all", "none"]


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
    seed: int | None = Field(
        None, description="passkey: generator seed (default: the top-level `seed`)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        if self.shards is not None and self.shards_idx >= self.shards:
            raise ValueError(f"`shards_idx` {self.shards_idx} must be below `shards` "
                             f"({self.shards})")
        if self.path is None and self.data_files is None and self.type != "passkey":
            raise ValueError(f"a `{self.type}` dataset needs a `path` or `data_files`")
        return self


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
    tokenizer: str | None = Field(
        None,
        description="Tokenizer path or hub id (default: `base_model`), or `byte` for the "
        "built-in byte-level tokenizer that needs no files.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Allow model/tokenizer code from the hub to run. Off unless you trust it.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Dtype of the model weights and compute."
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
    sequence_parallel_mode: Literal["ring", "ulysses", "hybrid"] = Field(
        "ring",
        description="ring: llama3-style all-gather of K,V; ulysses: all-to-all over heads; "
        "hybrid: ulysses inside groups of `ulysses_degree`, ring across them.",
    )
    ulysses_degree: int | None = Field(
        None,
        ge=1,
        description="hybrid: ranks per Ulysses group (must divide `sequence_parallel_degree`).",
    )
    heads_k_stride: int = Field(
        1,
        ge=1,
        description="ring: KV heads gathered per communication step; must divide the model's "
        "`num_key_value_heads`. Larger = fewer, bigger messages and more memory.",
    )
    ring_attn_func: Literal["varlen_llama3"] = Field(
        "varlen_llama3", description="Ring algorithm (llama3-style all-gather)."
    )
    sp_sharding: Literal["contiguous", "zigzag"] = Field(
        "contiguous",
        description="How a row is split across the SP group. zigzag balances causal work "
        "(torch kernel only); contiguous is what the flash kernel expects.",
    )
    attention_kernel: Literal["auto", "flash", "torch"] = Field(
        "auto",
        description="flash: ring-flash-attn + flash-attn (CUDA); torch: pure PyTorch "
        "(CPU or CUDA); auto: flash when available, else torch.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Megatron-style tensor parallelism with sequence-sharded activations "
        "(TP-sp) over this many consecutive ranks; the world is dp x tensor_parallel_size x "
        "sequence_parallel_degree. Heads, KV heads and intermediate size must divide by it.",
    )
    fsdp: bool = Field(
        False, description="Shard parameters, gradients and optimizer state with FSDP2."
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
    lr_scheduler: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = Field("cosine", description="Schedule (transformers.get_scheduler name).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    optimizer: Literal["adamw", "adamw_torch", "sgd"] = Field(
        "adamw", description="Optimizer (adamw and adamw_torch are torch.optim.AdamW)."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, description="Clip the global gradient norm to this (null: no clipping)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in backward to save activation memory."
    )
    chunked_loss: bool = Field(
        False,
        description="Compute lm_head + cross-entropy in token chunks with recomputation, "
        "never materialising the [tokens, vocab] logits.",
    )
    loss_chunk_size: int = Field(
        4096, ge=1, description="Tokens per chunk when `chunked_loss` is on."
    )
    activation_offloading: bool = Field(
        False, description="Keep activations saved for backward in host memory."
    )
    tiled_mlp: bool = Field(
        False, description="Run each MLP over the local tokens in tiles, recomputed in backward."
    )
    tiled_mlp_tiles: int | None = Field(
        None, ge=1, description="Number of MLP tiles (default: tokens / hidden_size, at least 1)."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="stop: a NaN/inf loss or gradient ends the run (the last checkpoint is "
        "kept); skip: drop that optimizer step and continue.",
    )
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")
    collective_timeout_s: int = Field(
        300,
        ge=10,
        description="Seconds a collective may wait before the job is declared hung and stopped.",
    )

    # ---- adapter -------------------------------------------------------------------------
    adapter: Literal["lora"] | None = Field(None, description="lora, or null for full fine-tuning.")
    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt, or `all-linear`.",
    )

    # ---- evaluation ----------------------------------------------------------------------
    eval_steps: int | None = Field(
        None, ge=1, description="Compute eval loss every this many optimizer steps."
    )
    eval_context_lengths: list[int] | None = Field(
        None,
        description="`longctx eval` passkey grid lengths (default: 4 lengths up to sequence_len).",
    )
    eval_depths: list[float] | None = Field(
        None, description="`longctx eval` passkey grid depths (default: 0.0, 0.25, ..., 1.0)."
    )
    eval_samples_per_cell: int = Field(
        4, ge=1, description="`longctx eval` passkey samples per (length, depth) cell."
    )
    eval_position_buckets: int = Field(
        16, ge=1, description="`longctx eval` number of position buckets for per-position loss."
    )

    # ---- output --------------------------------------------------------------------------
    output_dir: str = Field("./outputs", description="Where metrics, checkpoints and final/ go.")
    save_steps: int | None = Field(
        None, ge=1, description="Write a resumable checkpoint every this many optimizer steps."
    )
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep only the newest this many checkpoints."
    )
    logging_steps: int = Field(1, ge=1, description="Print a log line every this many steps.")
    use_tensorboard: bool = Field(False, description="Also log metrics to TensorBoard.")
    resume_from_checkpoint: str | None = Field(
        None, description="`auto` (newest complete checkpoint in output_dir) or a checkpoint path."
    )
    fidelity_probe: bool = Field(
        True,
        description="Before training (and in `validate`), check on a tiny random model of the "
        "same family that longctx computes exactly the model's own loss and gradients; refuse "
        "to train on any difference. `false` skips the check (docs/families.md).",
    )

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

    @model_validator(mode="after")
    def _model_source(self) -> Config:
        if self.base_model is None and self.model_config_dict is None:
            raise ValueError(
                "set `base_model` (hub id or local path) or `model_config` "
                "(an inline config with `model_type`)"
            )
        if self.model_config_dict is not None and "model_type" not in self.model_config_dict:
            raise ValueError("`model_config` needs a `model_type` key, e.g. `model_type: llama`")
        return self

    @property
    def prepared_path(self) -> str:
        return self.dataset_prepared_path or f"{self.output_dir.rstrip('/')}/prepared"

    @property
    def tokenizer_source(self) -> str | None:
        return self.tokenizer or self.base_model

"""The training section: batch and steps, the optimizer and its schedule, what trains in a
full fine-tune, and when a run stops on its own."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from longctx_cli.config.sections.base import Section

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
# Axolotl's optimizers that torch's own cannot reproduce, and why.
REFUSED_OPTIMIZERS = {
    "muon": (
        "the `muon` of Axolotl is not torch.optim.Muon: on more than one GPU (Axolotl then builds "
        "a device mesh, as for FSDP2) it is DistMuon (from Dion), whose Newton-Schulz "
        "iteration uses a different coefficient triple at each of its five steps and scales "
        "each update by sqrt(fan_out / fan_in), and on one process the Muon of Moonlight, which "
        "leaves every norm and bias out of the optimizer (never trained) and updates "
        "embeddings by its own AdamW; torch.optim.Muon runs one coefficient triple and scales "
        "by sqrt(max(1, fan_out / fan_in)) or 0.2 sqrt(max(fan_out, fan_in)), so it would "
        "train a different model than Axolotl does; use `optimizer: adamw` (or one of the "
        "others listed in docs/config.md)"),
}
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "warmup_stable_decay",
]


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


# What every parameter name of a peft-wrapped model starts with (`PeftModel.base_model.model`).
PEFT_PREFIX = "base_model.model."


def literal_prefix(regex: str) -> str | None:
    """The text every match of `regex` (matched from the start) begins with, as far as it is
    plain characters; None when the pattern branches (`|`), which this does not follow."""
    if "|" in regex:
        return None
    out, i = [], 1 if regex.startswith("^") else 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex) and not regex[i + 1].isalnum():
            char, i = regex[i + 1], i + 2  # an escaped punctuation mark is itself
        elif c in ".[](){}*+?^$\\":
            break
        else:
            char, i = c, i + 1
        if i < len(regex) and regex[i] in "*?{":  # the character may be absent
            break
        out.append(char)
        if i < len(regex) and regex[i] == "+":
            break
    return "".join(out)


def misses_adapter_names(pattern: str) -> bool:
    """The `unfrozen_parameters` entry can match no parameter of an adapter-wrapped model:
    its plain start differs from `base_model.model.`, with which all their names begin."""
    prefix = literal_prefix(unfrozen_pattern(pattern)[0].pattern)
    return prefix is not None and not (prefix.startswith(PEFT_PREFIX)
                                       or PEFT_PREFIX.startswith(prefix))


class TrainingSection(Section):
    title = "training"

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
    unfrozen_parameters: list[str] | None = Field(
        None,
        description="Full fine-tuning of only the parameters whose names match one of these "
        "patterns (Axolotl's syntax: a regular expression matched from the start of the name "
        "in which `.` is a literal dot except in `.+`, e.g. `model.layers.3[0-1].mlp`; a "
        "trailing `[start:end]` trains only those rows, e.g. new token embeddings: the others "
        "get no gradient, though a `weight_decay` still decays them, as in Axolotl); the rest "
        "stay frozen. With `adapter` the patterns are matched, as in Axolotl, against the "
        "adapter-wrapped names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A."
        "default.weight`) and may name adapter parameters only: those train, the rest of the "
        "adapter stays at its initial values.",
    )

    @field_validator("optimizer", mode="before")
    @classmethod
    def _refused_optimizer(cls, value: Any) -> Any:
        if isinstance(value, str) and value in REFUSED_OPTIMIZERS:
            raise ValueError(f"`optimizer: {value}`: {REFUSED_OPTIMIZERS[value]}")
        return value

    @field_validator("warmup_steps", mode="before")
    @classmethod
    def _whole_warmup_steps(cls, value: Any) -> Any:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(
                "it counts optimizer steps, a whole number (Axolotl's schema types it an "
                f"integer too); for a fraction of the run's steps write `warmup_ratio: {value}`")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainingSection:
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("`warmup_steps` and `warmup_ratio` say the same thing twice; keep "
                             "one")
        for pattern in self.unfrozen_parameters or []:
            try:
                unfrozen_pattern(pattern)
            except (re.error, ValueError) as e:
                raise ValueError(f"`unfrozen_parameters` entry {pattern!r} is not a pattern "
                                 f"({e})") from None
        return self

    @property
    def trains_rows_of_parameters(self) -> str | None:
        """The first `unfrozen_parameters` entry that trains only some rows, if any."""
        return next((p for p in self.unfrozen_parameters or []
                     if unfrozen_pattern(p)[1] is not None), None)


def optimizer_rows(training: TrainingSection) -> list[tuple[str, str]]:
    """The plan's optimizer and schedule rows."""
    warmup = (f"{training.warmup_ratio:g} of the steps" if training.warmup_ratio is not None
              else f"{training.warmup_steps or 0} steps")
    return [
        ("optimizer", f"{training.optimizer}, lr {training.learning_rate:g}, "
                      f"weight decay {training.weight_decay:g}"),
        ("schedule", f"{training.lr_scheduler}, warm-up {warmup}"),
    ]


def stop_rows(training: TrainingSection) -> list[tuple[str, str]]:
    """The plan's row of the rules that end a run early, if any."""
    stops = []
    if training.early_stopping_patience:
        stops.append(f"early stopping after {training.early_stopping_patience} evals without "
                     "improvement")
    if training.loss_watchdog_threshold:
        stops.append(f"loss > {training.loss_watchdog_threshold:g} for "
                     f"{training.loss_watchdog_patience} steps")
    return [("stops", "; ".join(stops))] if stops else []

"""The evaluation section: held-out loss during training, and what `longctx eval`
measures (the passkey grid, loss by position, RULER's tasks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from longctx_cli.config.sections.base import Section


class EvalSection(Section):
    title = "evaluation"

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

    @model_validator(mode="after")
    def _consistent(self) -> EvalSection:
        if self.eval_steps is not None and self.evals_per_epoch is not None:
            raise ValueError("`eval_steps` and `evals_per_epoch` say the same thing twice; keep "
                             "one")
        return self

    @property
    def scheduled(self) -> bool:
        """Some cadence asks for evaluations during training."""
        return bool(self.eval_steps or self.evals_per_epoch or self.eval_strategy == "epoch")

    def cadence_text(self) -> str:
        """When the eval loss is computed, as the plan prints it."""
        return ("never" if self.eval_strategy == "no" else "every epoch"
                if self.eval_strategy == "epoch" else f"{self.evals_per_epoch} per epoch"
                if self.evals_per_epoch else f"every {self.eval_steps:g} steps"
                if self.eval_steps else "none")

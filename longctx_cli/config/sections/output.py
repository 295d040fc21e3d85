"""The output section: where results go (metrics, checkpoints, trackers, the merged
model) and how a run resumes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from longctx_cli.config.sections.base import Section


class OutputSection(Section):
    title = "output"

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

    @model_validator(mode="after")
    def _consistent(self) -> OutputSection:
        if self.save_steps is not None and self.saves_per_epoch is not None:
            raise ValueError("`save_steps` and `saves_per_epoch` say the same thing twice; keep "
                             "one")
        return self

    @property
    def wandb_enabled(self) -> bool:
        """Axolotl's rule: wandb logs when a project is named, unless use_wandb says no."""
        if self.use_wandb is not None:
            return self.use_wandb
        return bool(self.wandb_project)

    def save_text(self) -> str:
        """When checkpoints are written, as the plan prints it."""
        return ("never" if self.save_strategy == "no" else "every epoch"
                if self.save_strategy == "epoch" else f"{self.saves_per_epoch} per epoch"
                if self.saves_per_epoch else f"every {self.save_steps:g} steps"
                if self.save_steps else "final model only")

    def trackers_text(self) -> str:
        """Where the metrics go, as the plan prints it."""
        trackers = ["metrics.jsonl"] + (["TensorBoard"] if self.use_tensorboard else []) + (
            [f"wandb ({self.wandb_project})"] if self.wandb_enabled else [])
        return ", ".join(trackers)

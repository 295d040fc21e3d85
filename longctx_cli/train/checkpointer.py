"""When a run saves, using checkpoint_files.py's writers: resume at the start, a checkpoint every
`save_interval` steps (Axolotl's cadence) and one at the end when saving is on, then the
Hugging Face export to `final/`. Every rank calls these: the saves are collective."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.launcher.supervise import clear_marker, resume_setting, write_marker
from longctx_cli.runtime.model import load_base_model
from longctx_cli.train.checkpoint_files import (
    export_final,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from longctx_cli.train.metrics import Metrics
from longctx_cli.train.schedule import DataPosition, interval


def save_interval(config: Config, steps_per_epoch: int, num_steps: int) -> int | None:
    output = config.output
    return interval(output.save_steps, output.saves_per_epoch, output.save_strategy,
                    steps_per_epoch, num_steps)


def random_init_base_saver(config: Config) -> Callable[[Path], None] | None:
    """For an adapter on a randomly initialised base (`model_config`): that base exists
    nowhere else, so it ships beside the adapter (unquantized)."""
    if config.lora.adapter is None or not config.model.random_init:
        return None

    def save_base(path: Path) -> None:
        load_base_model(config, "sdpa", quantize=False).save_pretrained(
            path, safe_serialization=True
        )

    return save_base


class Checkpointer:
    """The run's checkpoints; `last` is the newest complete one (for stop messages)."""

    def __init__(self, config: Config, data: DataPosition, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler):
        self.config, self.data = config, data
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.output_dir = Path(config.output.output_dir)
        self.every = save_interval(config, data.steps_per_epoch, data.num_steps)
        self.resumed_from: Path | None = None
        self.last: Path | None = None

    def resume(self) -> int:
        """Load `resume_from_checkpoint` (if any) into the run; returns the step to start at."""
        path = resolve_resume(resume_setting(self.config.output.resume_from_checkpoint,
                                             self.output_dir), self.output_dir)
        if path is None:
            return 0
        trainer_state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.data.restore(trainer_state, path)
        self.resumed_from = self.last = path
        return trainer_state["step"]

    def _save(self, steps: int) -> Path:
        return save_checkpoint(
            self.output_dir, steps, self.model, self.optimizer, self.scheduler,
            self.data.trainer_state(steps), keep=self.config.output.save_total_limit,
        )

    def maybe_save(self, step: int, metrics: Metrics) -> None:
        """Save after optimizer step `step` (0-based) on the cadence; the last step is left
        to `finish`, so it is never written twice."""
        done = step + 1
        if not self.every or done % self.every or done >= self.data.num_steps:
            return
        self.last = self._save(done)
        metrics.artifact(self.last, f"checkpoint-{done}")

    def preempt(self, step: int, metrics: Metrics, signal_name: str) -> Path:
        """The checkpoint after optimizer step `step` (0-based), written now unless the
        cadence just wrote it, and the marker that makes the next run resume from it."""
        done = step + 1
        if self.last is None or self.last.name != f"checkpoint-{done}":
            self.last = self._save(done)
            metrics.artifact(self.last, f"checkpoint-{done}")
        if _rank() == 0:
            write_marker(self.output_dir, done, self.last, signal_name)
        return self.last

    def finish(self, steps: int, tokenizer) -> Path:
        """The run's last checkpoint (`steps` done; when saving is on at all), then `final/`
        in Hugging Face format (full model or adapter) with the tokenizer; returns `final/`."""
        if self.every:
            self._save(steps)
        if _rank() == 0:
            clear_marker(self.output_dir)  # finished: nothing left to resume
        return export_final(self.model, tokenizer, self.output_dir / "final",
                            self.config.lora.adapter is not None,
                            random_init_base_saver(self.config))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0

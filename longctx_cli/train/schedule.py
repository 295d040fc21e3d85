"""The run's step schedule and where it is in its data: how many optimizer steps, which rows
each step reads, the every-N cadence Axolotl's save/eval keys describe, and the position of
streamed data (`pretraining_dataset`), which travels in the trainer state of a checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config import Config
from longctx_cli.data.stream import PackedStream
from longctx_cli.errors import UserError
from longctx_cli.runtime.batches import step_row_indices

if TYPE_CHECKING:
    from datasets import Dataset


def rows_per_batch(config: Config, dp_size: int) -> int:
    """Rows one batch reads: an optimizer step's (SFT, preference), or one generation batch's
    prompts (`rl: grpo`: `micro_batch_size` counts completions, `num_generations` per prompt,
    over `steps_per_generation` micro-batches)."""
    if config.objective.rl == "grpo":
        per_micro = config.training.micro_batch_size // config.trl.num_generations
        return dp_size * per_micro * config.generation_steps(dp_size)
    return dp_size * config.training.micro_batch_size * config.training.gradient_accumulation_steps


def steps_per_batch(config: Config, dp_size: int) -> int:
    """Optimizer steps on one batch's rows (`rl: grpo`: the steps a generation batch is split
    over, times `trl.num_iterations`; else 1)."""
    if config.objective.rl != "grpo":
        return 1
    split = config.generation_steps(dp_size) // config.training.gradient_accumulation_steps
    return split * config.trl.num_iterations


def total_steps(config: Config, num_rows: int, dp_size: int) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps); the last partial step of an epoch is dropped."""
    per_step = rows_per_batch(config, dp_size)
    steps_per_epoch = num_rows // per_step * steps_per_batch(config, dp_size)
    if steps_per_epoch == 0:
        if config.objective.rl == "grpo":
            needs = (f"prompts but one generation batch needs {per_step} (dp {dp_size} x "
                     f"micro_batch_size {config.training.micro_batch_size} / num_generations "
                     f"{config.trl.num_generations} x steps_per_generation "
                     f"{config.generation_steps(dp_size)})")
        else:
            needs = (f"packed rows but one optimizer step needs {per_step} (dp {dp_size} x "
                     f"micro_batch_size {config.training.micro_batch_size} x "
                     f"gradient_accumulation_steps {config.training.gradient_accumulation_steps})")
        raise UserError(
            f"the training set has {num_rows} {needs}.",
            where="datasets",
            fix="add data, or lower micro_batch_size / gradient_accumulation_steps"
            + (" / trl.steps_per_generation." if config.objective.rl == "grpo" else "."),
        )
    if config.training.max_steps is not None:
        return steps_per_epoch, config.training.max_steps
    return steps_per_epoch, max(1, math.ceil(config.training.num_epochs * steps_per_epoch))


def interval(
    steps: int | float | None, per_epoch: int | None, strategy: str | None,
    steps_per_epoch: int, num_steps: int,
) -> int | None:
    """Optimizer steps between saves (or evals), Axolotl's way: `no` never; `epoch` once per
    epoch; N per epoch; every N steps; a fraction < 1 of the total steps."""
    if strategy == "no":
        return None
    if strategy == "epoch":
        return steps_per_epoch
    if per_epoch:
        return max(1, steps_per_epoch // per_epoch)
    if steps is None:
        return None
    if steps < 1:
        return max(1, round(steps * num_steps))
    return int(steps)


# ---- streamed data ------------------------------------------------------------------------


def stream_step_rows(stream: PackedStream, per_step: int) -> tuple[Dataset, list[int]]:
    """The next step's rows; every rank reads the same stream and keeps its own slice."""
    from datasets import Dataset

    return Dataset.from_list(stream.next_rows(per_step)), list(range(per_step))


def data_state(stream: PackedStream | None) -> dict:
    """The trainer-state entry of a checkpoint that holds the stream position (if any)."""
    return {"data": {"stream": stream.state_dict()}} if stream is not None else {}


def restore_stream(stream: PackedStream, trainer_state: dict, path: Path) -> None:
    saved = trainer_state.get("data", {}).get("stream")
    if saved is None:
        raise UserError(
            f"{path} has no stream position, so the streamed data cannot resume where it "
            "stopped.",
            where="resume_from_checkpoint",
            fix="resume from a checkpoint of a `pretraining_dataset` run, or start afresh.",
        )
    stream.load_state_dict(saved)


# ---- the position -------------------------------------------------------------------------


class DataPosition:
    """The training rows and the run's place in them: the cached rows, indexed by step (a
    seeded shuffle per epoch), or a stream that is simply read on (`max_steps` long)."""

    def __init__(self, config: Config, dp_size: int, train_rows: Dataset | None,
                 stream: PackedStream | None):
        # rl: kto reads its rows in order: each micro-batch is one of TRL's batches (data/kto.py).
        self.seed, self.shuffle = config.training.seed, not (
            config.data.curriculum_sampling or config.objective.rl == "kto")
        self.rows, self.stream = train_rows, stream
        self.per_step = rows_per_batch(config, dp_size)
        if stream is not None:
            self.steps_per_epoch = self.num_steps = config.training.max_steps
        else:
            self.steps_per_epoch, self.num_steps = total_steps(config, len(train_rows), dp_size)

    def step_rows(self, step: int) -> tuple[Dataset, list[int]]:
        """The rows of optimizer step `step` (0-based) and the indices of the step in them."""
        if self.stream is not None:
            return stream_step_rows(self.stream, self.per_step)
        indices = step_row_indices(step, self.steps_per_epoch, self.per_step, len(self.rows),
                                   self.seed, self.shuffle)
        return self.rows, indices

    def trainer_state(self, step: int) -> dict:
        """What a checkpoint after `step` optimizer steps records of the data position."""
        return {"step": step, "epoch": step / self.steps_per_epoch, **data_state(self.stream)}

    def restore(self, trainer_state: dict, path: Path) -> None:
        """Continue where the checkpoint at `path` stopped (cached rows: the step is enough)."""
        if self.stream is not None:
            restore_stream(self.stream, trainer_state, path)

"""Why a run stops before its last step, with Axolotl's meanings: early stopping on the eval
loss, the training-loss watchdog, and a NaN/inf step under `on_nonfinite: stop`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.train.step import NonFiniteError

EARLY_STOPPING = "early_stopping"
LOSS_WATCHDOG = "loss_watchdog"


@dataclass
class EarlyStopping:
    """Stop after `patience` evaluations in a row without a new best eval loss."""

    patience: int | None
    best: float = math.inf
    bad: int = 0

    def should_stop(self, eval_loss: float) -> bool:
        if self.patience is None:
            return False
        if eval_loss < self.best:
            self.best, self.bad = eval_loss, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


@dataclass
class LossWatchdog:
    """Axolotl's loss watchdog: the training loss above a threshold for `patience` steps in
    a row means the run has broken down."""

    threshold: float | None
    patience: int
    high: int = 0

    def tripped(self, loss: float) -> bool:
        if self.threshold is None:
            return False
        self.high = self.high + 1 if not loss <= self.threshold else 0  # NaN counts as high
        return self.high >= self.patience


class Stopper:
    """The stop rules of one run; `check` after every step names the rule that ends it."""

    def __init__(self, config: Config):
        self.config = config
        self.early = EarlyStopping(config.training.early_stopping_patience)
        self.watchdog = LossWatchdog(config.training.loss_watchdog_threshold,
                                     config.training.loss_watchdog_patience)

    def check(self, loss: float, eval_loss: float | None) -> str | None:
        """EARLY_STOPPING, LOSS_WATCHDOG or None; the watchdog wins when both fire."""
        stop = None
        # Early stopping counts evaluations, so it only hears of steps that evaluated.
        if eval_loss is not None and self.early.should_stop(eval_loss):
            stop = EARLY_STOPPING
        if self.watchdog.tripped(loss):
            stop = LOSS_WATCHDOG
        return stop

    def early_stopping_line(self, step: int) -> str:
        return (f"early stopping at step {step + 1}: eval loss did not improve "
                f"for {self.config.training.early_stopping_patience} evaluations")

    def watchdog_error(self, step: int, last_checkpoint: Path | None) -> UserError:
        return UserError(
            f"step {step + 1}: the training loss stayed above "
            f"{self.config.training.loss_watchdog_threshold} for "
            f"{self.config.training.loss_watchdog_patience} "
            f"steps in a row; training stopped (last checkpoint: {last_checkpoint or 'none'}).",
            where="loss_watchdog_threshold",
            fix="lower learning_rate or raise warmup, check the data, or raise/remove "
            "loss_watchdog_threshold.",
        )


def nonfinite_error(step: int, error: NonFiniteError, last_checkpoint: Path | None) -> UserError:
    """The user's view of a NaN/inf step under `on_nonfinite: stop`."""
    kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else (
        "no checkpoint was written yet")
    return UserError(
        f"step {step + 1}: {error.what} is NaN or infinite; training stopped and {kept}.",
        where="on_nonfinite",
        fix="lower learning_rate, raise warmup_steps, check the data, or set "
        "`on_nonfinite: skip` to drop such steps.",
    )

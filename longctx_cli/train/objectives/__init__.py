"""What one optimizer step trains: an objective behind one small protocol.

An objective hands the step its micro-batches (rows read from the prepared data, or GRPO's
rollouts), the step's divisor (a collective: the step's valid tokens, pairs, or 1 where the
loss of a micro-batch is already its share), the summed loss of one micro-batch with the
metric values behind it, and, after the update, the step's metrics. `train/step.py` owns
everything else: accumulation, gradient sync, autocast, backward and the update.

- `causal_lm.py`: SFT and pretraining rows, summed CE over the step's valid tokens.
- `preference.py`: the DPO family (`rl: dpo/ipo/simpo/orpo`), pair losses over the step's pairs.
- `grpo.py`: `rl: grpo`, rollouts as the micro-batch source, TRL's GRPO loss.
- `kto.py`: `rl: kto`, TRL's KTO loss with its KL reference point on KTO rows.
- `reward_training.py`: `reward_model: true`, TRL's reward-model loss over the step's pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.train.precision import Precision


@dataclass(frozen=True)
class StepCounts:
    """What a step divides by (`divisor`) and the valid tokens it reports (`tokens`)."""

    divisor: float
    tokens: int
    nll_weight: float = 1.0  # orpo: pairs / chosen targets of the step (PreferenceLoss)


@dataclass
class LossShare:
    """One micro-batch: its summed loss (the step divides it by `StepCounts.divisor`), this
    rank's share of it as the world's loss sum counts it (`reported`), and the values behind
    the objective's metrics (the objective reads them back in `step_metrics`)."""

    loss_sum: torch.Tensor
    reported: float
    metrics: dict[str, Any] = field(default_factory=dict)


class Objective(Protocol):
    """An objective of a run (see the module doc); `shown`: what the step line shows of its
    metrics (None: all)."""

    shown: tuple[str, ...] | None

    def micro_batches(self, step: int, use_fsdp: bool, precision: Precision) -> Sequence[Any]:
        """This rank's micro-batches of optimizer step `step`."""
        ...

    def counts(self, batches: Sequence[Any]) -> StepCounts:
        """The step's divisor and token count over the world (a collective)."""
        ...

    def loss_share(self, batch: Any, counts: StepCounts) -> LossShare:
        """The forward of one micro-batch (under the step's autocast) and its loss."""
        ...

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        """The step's metrics from its micro-batches' `LossShare.metrics`, after the update
        (collectives: every rank calls it)."""
        ...


class PreparedRows:
    """The micro-batches of a run on prepared rows: each step's rows (`DataPosition`),
    sharded for this rank."""

    def __init__(self, data, config: Config, state: ParallelState, pad_id: int):
        self.data, self.config, self.state, self.pad_id = data, config, state, pad_id

    def micro_batches(self, step: int) -> list[ShardedBatch]:
        from longctx_cli.runtime.batches import micro_batches

        return micro_batches(*self.data.step_rows(step), self.config, self.state, self.pad_id)


class OnRows:
    """An objective whose micro-batches are prepared rows (`rows`; None: the caller hands
    the step its batches, as the tests and the family matrix do)."""

    rows: PreparedRows | None

    def micro_batches(self, step: int, use_fsdp: bool, precision: Precision,
                      ) -> list[ShardedBatch]:
        assert self.rows is not None, "an objective without rows is handed its batches"
        return self.rows.micro_batches(step)

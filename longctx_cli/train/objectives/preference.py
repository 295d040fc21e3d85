"""The preference objective (`rl: dpo/ipo/simpo/orpo`): the pair losses of
`train/preference.py` summed per micro-batch, the step divided by its pair count. A pair's
loss is the same on every rank of its SP x TP group: the first rank of the group counts it
(and reports its metrics) once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.train.objectives import LossShare, OnRows, PreparedRows, StepCounts
from longctx_cli.train.preference import PreferenceLoss, chosen_targets, preference_loss_sum


class Preference(OnRows):
    """TRL's DPO-family losses over the step's pairs, with TRL's metrics (means over pairs)."""

    shown = None

    def __init__(self, config: Config, state: ParallelState, model: torch.nn.Module,
                 decoder: torch.nn.Module, lm_head: torch.nn.Module, loss: PreferenceLoss,
                 rows: PreparedRows | None = None):
        self.config, self.state, self.model = config, state, model
        self.decoder, self.lm_head, self.loss, self.rows = decoder, lm_head, loss, rows
        self.counted = state.sp_rank == 0 and state.tp_rank == 0  # once per SP x TP group

    def counts(self, batches: Sequence[ShardedBatch]) -> StepCounts:
        local_count = sum(valid_token_count(b.shift_labels) for b in batches)
        local_pairs = sum(b.num_documents // 2 for b in batches) if self.counted else 0
        scores = self.counted and self.loss.scores_prompts
        local_chosen = sum(map(chosen_targets, batches)) if scores else 0
        tokens, pairs, chosen = all_reduce_sum([local_count, local_pairs, local_chosen],
                                               self.state.device)
        # orpo: the pairs' mean of the NLL shares must be the mean over the step's chosen targets.
        return StepCounts(max(pairs, 1.0), int(tokens), pairs / chosen if chosen else 1.0)

    def loss_share(self, batch: ShardedBatch, counts: StepCounts) -> LossShare:
        pairs = preference_loss_sum(self.model, self.decoder, self.lm_head, batch, self.config,
                                    self.state, self.loss, nll_weight=counts.nll_weight)
        return LossShare(pairs.loss_sum, pairs.loss_sum.item() * self.counted,
                         {k: v * self.counted for k, v in pairs.metric_sums.items()})

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        sums: dict[str, float] = {}
        for value_of in values:
            for key, value in value_of.items():
                sums[key] = sums.get(key, 0.0) + value
        totals = all_reduce_sum(list(sums.values()), self.state.device) if sums else []
        return {k: v / counts.divisor for k, v in zip(sums, totals, strict=True)}

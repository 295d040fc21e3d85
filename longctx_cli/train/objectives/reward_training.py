"""Reward-model training (`reward_model: true`): TRL's `RewardTrainer` loss on preference rows
sharded over an SP group.

The rows are preference rows (`data/preference.py`): document `2k` the chosen and `2k + 1`
the rejected sequence of pair `k`. The model is a sequence-classification model (`score`, one
output); each sequence's reward is the score of its pooled token, HF's rule on TRL's
right-padded batch: the sequence's last token that is not the pad id (its first token when
every one is). Each rank scores the pooled tokens it holds; one all-reduce over the SP group
hands every rank all the rewards, the gradient passing straight through to the rank that
scored each one (as `train/preference.py` sums log-probabilities), so the step's gradient
sync adds the shares up to the single-device gradient.

A pair's loss is TRL's: `-logsigmoid(r_chosen - r_rejected - margin)` (the margin 0 without
TRL's `margin` column) plus `center_rewards_coefficient * (r_chosen + r_rejected) ** 2`;
TRL's micro-batch loss is their mean over its pairs, so the step divides the summed losses by
its pair count (equal micro-batches: TRL's mean over the accumulation window and the
processes). The metrics are TRL's: `accuracy` and `margin` (means over the pairs),
`min_reward`, `mean_reward`, `max_reward` (over every sequence of a micro-batch in the world,
averaged over the step's micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch, SPMeta, slice_sequence
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.model import sp_hidden_states
from longctx_cli.train.objectives import LossShare, OnRows, PreparedRows, StepCounts
from longctx_cli.train.preference import sum_over_row

# TRL's metric names, in the order the step shows them.
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


@dataclass(frozen=True)
class RewardLoss:
    """TRL's `RewardConfig` settings (its names and defaults)."""

    center_rewards_coefficient: float | None = None

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor,
                    margins: torch.Tensor | None = None) -> torch.Tensor:
        """Each pair's loss `[pairs]` (TRL's micro-batch loss is their mean)."""
        delta = chosen - rejected if margins is None else chosen - rejected - margins
        losses = -F.logsigmoid(delta)
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        return losses


def _global_positions(meta: SPMeta) -> torch.Tensor:
    """The row position of each token this rank holds, in local order."""
    return slice_sequence(torch.arange(meta.total_len), meta.ctx)


def pooled_positions(batch: ShardedBatch, state: ParallelState, pad_id: int | None,
                     ) -> torch.Tensor:
    """The row position each document is scored at (`[documents]`, the same on every rank of
    the SP group; a collective over it): its last token that is not `pad_id`, else its first."""
    meta = batch.sp_meta
    docs = batch.num_documents
    positions = meta.derived(_global_positions)
    bounds = torch.tensor(meta.cu_host[1:])
    doc_of = torch.searchsorted(bounds, positions.contiguous(), right=True)
    ids = batch.input_ids.reshape(-1).cpu()
    kept = (doc_of < docs) & (ids != pad_id) if pad_id is not None else doc_of < docs
    last = torch.full((docs,), -1, dtype=torch.long)
    last.scatter_reduce_(0, doc_of[kept], positions[kept], reduce="amax")
    if state.layout.sp > 1:
        last = last.to(state.device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=state.sp_group)
        last = last.cpu()
    starts = torch.tensor(meta.cu_host[:docs])
    return torch.where(last < 0, starts, last)


def sequence_rewards(score: torch.nn.Module, hidden: torch.Tensor, batch: ShardedBatch,
                     state: ParallelState, pad_id: int | None) -> torch.Tensor:
    """Every document's reward `[documents]` on every rank of the SP group; each rank's
    backward reaches only the pooled tokens it holds."""
    pooled = pooled_positions(batch, state, pad_id)
    positions = batch.sp_meta.derived(_global_positions)
    held = torch.nonzero(positions.unsqueeze(1) == pooled.unsqueeze(0))  # (local, document)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    scores = score(hidden[held[:, 0].to(hidden.device)]).float()[:, 0]
    local = scores.new_zeros(batch.num_documents).index_add(0, held[:, 1].to(hidden.device),
                                                            scores)
    return sum_over_row(local, state)


@dataclass
class RewardPairsResult:
    loss_sum: torch.Tensor  # the summed pair losses (the same on every SP rank)
    pairs: int
    rewards: torch.Tensor  # [documents], detached: chosen and rejected alternating
    metric_sums: dict[str, float]  # sums over the pairs of `accuracy` and `margin`


def reward_loss_sum(decoder: torch.nn.Module, score: torch.nn.Module, batch: ShardedBatch,
                    state: ParallelState, loss: RewardLoss, pad_id: int | None,
                    margins: torch.Tensor | None = None) -> RewardPairsResult:
    """The summed pair losses of one micro-batch (the caller divides by the step's pairs);
    `margins` `[pairs]`: TRL's `margin` column, in the row's pair order."""
    rewards = sequence_rewards(score, sp_hidden_states(decoder, batch), batch, state, pad_id)
    pairs = batch.num_documents // 2
    chosen, rejected = rewards[0 : 2 * pairs : 2], rewards[1 : 2 * pairs : 2]
    if margins is not None:
        margins = margins.to(rewards)
    losses = loss.pair_losses(chosen, rejected, margins)
    gap = (chosen - rejected).detach()
    return RewardPairsResult(losses.sum(), pairs, rewards.detach()[: 2 * pairs],
                             {"accuracy": float((gap > 0).sum()), "margin": float(gap.sum())})


class RewardTraining(OnRows):
    """TRL's reward-model loss over the step's pairs, with TRL's metrics. A pair's loss is the
    same on every rank of its SP group: the group's first rank counts it once."""

    shown = None

    def __init__(self, state: ParallelState, decoder: torch.nn.Module, score: torch.nn.Module,
                 loss: RewardLoss, pad_id: int | None, rows: PreparedRows | None = None):
        self.state, self.decoder, self.score, self.loss = state, decoder, score, loss
        self.pad_id, self.rows = pad_id, rows
        self.counted = state.sp_rank == 0 and state.tp_rank == 0  # once per SP x TP group

    def counts(self, batches: Sequence[ShardedBatch]) -> StepCounts:
        local_count = sum(valid_token_count(b.shift_labels) for b in batches)
        local_pairs = sum(b.num_documents // 2 for b in batches) if self.counted else 0
        tokens, pairs = all_reduce_sum([local_count, local_pairs], self.state.device)
        return StepCounts(max(pairs, 1.0), int(tokens))

    def loss_share(self, batch: ShardedBatch, counts: StepCounts) -> LossShare:
        result = reward_loss_sum(self.decoder, self.score, batch, self.state, self.loss,
                                 self.pad_id)
        rewards = result.rewards
        inf = float("inf")
        metrics = {k: v * self.counted for k, v in result.metric_sums.items()}
        metrics["reward_sum"] = float(rewards.sum()) * self.counted
        metrics["rewards"] = 2 * result.pairs * self.counted
        metrics["min_reward"] = float(rewards.min()) if self.counted and result.pairs else inf
        metrics["max_reward"] = float(rewards.max()) if self.counted and result.pairs else -inf
        return LossShare(result.loss_sum, result.loss_sum.item() * self.counted, metrics)

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        device = self.state.device
        accuracy, margin, reward_sum, rewards = all_reduce_sum(
            [sum(v[k] for v in values) for k in ("accuracy", "margin", "reward_sum", "rewards")],
            device)
        extremes = torch.tensor([[v["min_reward"], -v["max_reward"]] for v in values],
                                dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        low, high = extremes[:, 0].mean().item(), -extremes[:, 1].mean().item()
        return {"accuracy": accuracy / counts.divisor, "margin": margin / counts.divisor,
                "min_reward": low, "mean_reward": reward_sum / max(rewards, 1.0),
                "max_reward": high}

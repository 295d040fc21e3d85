"""KTO (TRL's `KTOTrainer` loss, `loss_type` kto or apo_zero_unpaired) on rows sharded over an
SP group.

A KTO example is two documents back to back, as a preference pair is laid out
(`train/preference.py`): document `2k` is `prompt_k + completion_k`, document `2k + 1` the
mismatched `prompt_k + completion_j` that TRL scores for its KL reference estimate (the
completions rotated by one within each batch: `KL_completion_ids`). Each rank sums its own
targets' log-probabilities per document and the SP (and TP) group's all-reduce gives every
rank the whole sequences' sums (`sequence_logps`), under the policy and under the
reference (the adapter switched off, `no_grad`). The KL estimate is TRL's: the mean over
the micro-batch's examples of the mismatched sequences' policy minus reference
log-probabilities, averaged over the DP ranks (TRL's `gather_for_metrics(kl).mean()` over
its processes), clamped at 0 and detached; the mismatched documents get no gradient.

Each example's loss is weighted by `desirable_weight` (label true) or `undesirable_weight`;
TRL's micro-batch loss is their mean over the micro-batch's examples, so the step divides the
summed losses by the step's example count (equal micro-batches: TRL's mean over the
accumulation window and the processes). `Kto` is the objective of `rl: kto`: its micro-batches
are prepared KTO rows (`data/kto.py`, one example per row with its `kto_label`, read in order)
with their labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.model import sp_hidden_states
from longctx_cli.train.objectives import LossShare, PreparedRows, StepCounts
from longctx_cli.train.precision import Precision
from longctx_cli.train.preference import SequenceLogps, reference_model, sequence_logps

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# TRL's names of the per-example values it averages (over the chosen or the rejected ones).
METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class KtoLoss:
    """TRL's KTO settings (`KTOConfig`'s names and defaults)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    @classmethod
    def from_config(cls, config: Config) -> KtoLoss:
        """`rl: kto`'s settings: `rl_beta`, `kto_desirable_weight`, `kto_undesirable_weight`."""
        objective = config.objective
        return cls(objective.preference_beta, objective.kto_desirable_weight or 1.0,
                   objective.kto_undesirable_weight or 1.0)

    @property
    def uses_kl(self) -> bool:
        """Whether the loss reads the KL reference point (TRL's `calculate_KL`: its
        apo_zero_unpaired has none, and logs a KL of 0)."""
        return self.loss_type == "kto"

    def example_losses(self, policy: SequenceLogps, reference: SequenceLogps,
                       labels: torch.Tensor, kl: torch.Tensor,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted loss of each example `[examples]` and TRL's per-example metric
        values (zero where the metric does not count the example); `policy.chosen` holds
        the examples' completions, `policy.rejected` their mismatched KL sequences."""
        desirable = labels.to(torch.bool)
        ratios = policy.chosen - reference.chosen
        if self.loss_type == "kto":  # Eq. (7) of the KTO paper, as TRL writes it
            chosen_losses = 1 - F.sigmoid(self.beta * (ratios - kl))
            rejected_losses = 1 - F.sigmoid(self.beta * (kl - ratios))
        elif self.loss_type == "apo_zero_unpaired":
            chosen_losses = 1 - F.sigmoid(self.beta * ratios)
            rejected_losses = F.sigmoid(self.beta * ratios)
        else:
            raise ValueError(f"unknown kto loss type {self.loss_type!r}")
        losses = torch.where(desirable, self.desirable_weight * chosen_losses,
                             self.undesirable_weight * rejected_losses)
        rewards = self.beta * ratios.detach()
        logps = policy.chosen.detach()
        zero = torch.zeros_like(rewards)
        values = dict(zip(METRICS, (
            torch.where(desirable, rewards, zero), torch.where(desirable, zero, rewards),
            torch.where(desirable, logps, zero), torch.where(desirable, zero, logps)),
            strict=True))
        values["count/chosen"] = desirable.to(rewards)
        values["count/rejected"] = (~desirable).to(rewards)
        return losses, values


def kl_estimate(policy: SequenceLogps, reference: SequenceLogps, state: ParallelState,
                ) -> torch.Tensor:
    """TRL's KL reference point of a micro-batch: the mean over its examples of the
    mismatched sequences' log-ratios, averaged over the DP ranks, clamped at 0, detached
    (a collective over the world: every rank of an SP x TP group holds the same sums, and
    only its first rank adds them)."""
    kl = (policy.rejected - reference.rejected).detach().mean()
    if dist.is_initialized() and dist.get_world_size() > 1:
        counted = state.sp_rank == 0 and state.tp_rank == 0
        kl = kl * counted
        dist.all_reduce(kl)
        kl = kl / state.layout.dp
    return kl.clamp(min=0)


@dataclass
class ExamplesResult:
    loss_sum: torch.Tensor  # the summed weighted losses (the same on every SP rank)
    examples: int
    kl: float
    metric_sums: dict[str, float]  # sums over the examples of `METRICS` and the counts


def kto_loss_sum(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module,
                 batch: ShardedBatch, labels: torch.Tensor, state: ParallelState,
                 loss: KtoLoss, chunk_size: int | None = None) -> ExamplesResult:
    """The summed KTO losses of one micro-batch (the caller divides by the step's examples);
    `labels` `[examples]`: each example's desirability, in the row's order."""
    policy = sequence_logps(head, sp_hidden_states(decoder, batch), batch, state, chunk_size)
    with torch.no_grad(), reference_model(model):
        reference = sequence_logps(head, sp_hidden_states(decoder, batch), batch, state,
                                   chunk_size)
    kl = (kl_estimate(policy, reference, state) if loss.uses_kl
          else policy.chosen.new_zeros(()))
    losses, values = loss.example_losses(policy, reference, labels.to(policy.chosen.device), kl)
    return ExamplesResult(losses.sum(), int(losses.numel()), float(kl),
                          {k: float(v.sum()) for k, v in values.items()})


@dataclass(frozen=True)
class KtoBatch:
    """A micro-batch of KTO rows: its sharded documents and each example's label."""

    batch: ShardedBatch
    labels: torch.Tensor  # [examples], bool, in the row's order


class Kto:
    """`rl: kto`: TRL's KTO loss over the step's examples, with TRL's metrics (the KL point
    averaged over the micro-batches, rewards and log-probabilities over the chosen and the
    rejected examples). An example's loss is the same on every rank of its SP x TP group:
    the first rank of the group counts it (and its metrics) once."""

    shown = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins")

    def __init__(self, config: Config, state: ParallelState, model: torch.nn.Module,
                 decoder: torch.nn.Module, lm_head: torch.nn.Module, loss: KtoLoss,
                 rows: PreparedRows | None = None):
        self.config, self.state, self.model = config, state, model
        self.decoder, self.lm_head, self.loss, self.rows = decoder, lm_head, loss, rows
        self.counted = state.sp_rank == 0 and state.tp_rank == 0  # once per SP x TP group

    def micro_batches(self, step: int, use_fsdp: bool, precision: Precision) -> list[KtoBatch]:
        assert self.rows is not None, "an objective without rows is handed its batches"
        batches = self.rows.micro_batches(step)
        labels = self.rows.data.rows.select([i for b in batches for i in b.rows])["kto_label"]
        out, start = [], 0
        for b in batches:  # each batch records its rows, in order
            out.append(KtoBatch(b, torch.tensor(labels[start:start + len(b.rows)])))
            start += len(b.rows)
        return out

    def counts(self, batches: Sequence[KtoBatch]) -> StepCounts:
        local_count = sum(valid_token_count(b.batch.shift_labels) for b in batches)
        local_examples = sum(len(b.labels) for b in batches) if self.counted else 0
        tokens, examples = all_reduce_sum([local_count, local_examples], self.state.device)
        return StepCounts(max(examples, 1.0), int(tokens))

    def loss_share(self, batch: KtoBatch, counts: StepCounts) -> LossShare:
        chunk = self.config.memory.loss_chunk_size if self.config.memory.chunked_loss else None
        result = kto_loss_sum(self.model, self.decoder, self.lm_head, batch.batch, batch.labels,
                              self.state, self.loss, chunk)
        metrics = {k: v * self.counted for k, v in result.metric_sums.items()}
        metrics["kl"] = result.kl * self.counted  # the same on every rank: a mean over batches
        metrics["batches"] = float(self.counted)
        return LossShare(result.loss_sum, result.loss_sum.item() * self.counted, metrics)

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        keys = [*METRICS, "count/chosen", "count/rejected", "kl", "batches"]
        local = [sum(v[k] for v in values) for k in keys]
        sums = dict(zip(keys, all_reduce_sum(local, self.state.device), strict=True))
        out = {"kl": sums["kl"] / max(sums["batches"], 1.0)}
        for key in METRICS:  # TRL's means over the chosen (or rejected) examples
            side = key.split("/")[1]
            if sums[f"count/{side}"]:
                out[key] = sums[key] / sums[f"count/{side}"]
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

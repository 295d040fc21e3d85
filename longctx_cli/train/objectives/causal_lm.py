"""The causal-LM objective (SFT and pretraining rows): the single-device mean over every
valid target token of the step. Each rank sums CE over its own shard; the divisor is the
exact valid-token count over the SP group, the DP group and the accumulation window."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.loss import lm_loss_sum, valid_token_count
from longctx_cli.runtime.model import sp_hidden_states
from longctx_cli.train.objectives import LossShare, OnRows, PreparedRows, StepCounts


def forward_loss_sum(decoder, lm_head, batch: ShardedBatch, config: Config,
                     state: ParallelState) -> torch.Tensor:
    """Summed CE of this rank's shard of one micro-batch (the caller divides)."""
    hidden = sp_hidden_states(decoder, batch)
    chunk = config.memory.loss_chunk_size if config.memory.chunked_loss else None
    if state.layout.tp > 1:  # vocab-parallel CE over the TP group
        from longctx_cli.parallel.tensor_parallel import tp_loss_sum

        return tp_loss_sum(lm_head, hidden, batch.shift_labels, state, chunk)
    return lm_loss_sum(lm_head, hidden, batch.shift_labels, chunk)


class CausalLm(OnRows):
    """Summed CE of each micro-batch over the step's valid tokens (every rank counts its own)."""

    shown = None

    def __init__(self, config: Config, state: ParallelState, decoder: torch.nn.Module,
                 lm_head: torch.nn.Module, rows: PreparedRows | None = None):
        self.config, self.state, self.decoder, self.lm_head = config, state, decoder, lm_head
        self.rows = rows

    def counts(self, batches: Sequence[ShardedBatch]) -> StepCounts:
        local = sum(valid_token_count(b.shift_labels) for b in batches)
        (tokens,) = all_reduce_sum([local], self.state.device)
        return StepCounts(max(tokens, 1.0), int(tokens))

    def loss_share(self, batch: ShardedBatch, counts: StepCounts) -> LossShare:
        loss_sum = forward_loss_sum(self.decoder, self.lm_head, batch, self.config, self.state)
        return LossShare(loss_sum, loss_sum.item())

    def step_metrics(self, values: list[dict], counts: StepCounts) -> dict[str, float]:
        return {}

"""Preference losses on rows sharded over an SP group: DPO (TRL's loss types), IPO, SimPO,
ORPO.

A row holds whole pairs, document `2k` the chosen and `2k + 1` the rejected sequence of pair
`k` (`data/preference.py`). Each rank sums the log-probabilities of its own targets per
document (labels were shifted once on the full row, as for SFT; under TP-sp, its part of the
SP shard, vocab-parallel); all-reducing over the SP (and TP) group gives every rank the whole
sequences' sums, and no rank ever holds the full row's `[tokens, vocab]` logits. That
all-reduce passes gradients straight through: every rank computes the same pair losses from
the same sums, and the backward of rank `r` reaches only the tokens it holds, so the
gradient sync that sums over the ranks of a replica (as for SFT) adds the shares up to the
single-device gradient.

The losses are TRL's (DPOTrainer for dpo/ipo, CPOTrainer's `simpo` for simpo, ORPOTrainer
for orpo), so are the metric names. ORPO adds the negative log-likelihood of the chosen
sequences, prompt included, as a mean over all their targets in the step: each rank also
sums the log-probabilities of every token's successor in the chosen documents (the batch's
`next_tokens`), and the step hands in the weight that turns those sums into that mean.

The reference of dpo/ipo is either the base model with the adapter switched
off, run under `no_grad` on the same sharded rows, or (a full fine-tune, a continued adapter,
or `precompute_ref_log_probs`) every pair's log-probabilities under the initial weights,
computed once before training in one SP pass and kept in `output_dir` for resumes.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longctx_cli.config import Config
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch, SPMeta, slice_sequence
from longctx_cli.runtime.batches import row_batch
from longctx_cli.runtime.model import decoder_and_head, sp_hidden_states

if TYPE_CHECKING:
    from datasets import Dataset

REFERENCE_FILE = "reference_logps.pt"

# TRL's names, in the order the metrics file and the summary show them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
# What ORPOTrainer logs besides (its `logits/*` means need the full logits: not shown).
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclass(frozen=True)
class PreferenceLoss:
    """The preference objective of a run (`rl:` and its keys)."""

    method: str  # dpo, ipo, simpo, orpo
    loss_types: tuple[str, ...]  # dpo/ipo: TRL's loss types, summed with `loss_weights`
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float
    simpo_gamma: float
    precomputed: bool = False  # reference log-probs from `table`, not the adapter switched off
    table: ReferenceTable | None = None

    @classmethod
    def from_config(cls, config: Config) -> PreferenceLoss | None:
        if config.objective.rl in (None, "grpo", "kto"):  # objectives/grpo.py, objectives/kto.py
            return None
        types = tuple(config.objective.dpo_loss_type or ())
        weights = tuple(config.objective.dpo_loss_weights or [1.0] * len(types))
        objective = config.objective
        return cls(objective.rl, types, weights, objective.preference_beta,
                   objective.dpo_label_smoothing, objective.simpo_gamma,
                   config.precomputed_reference)

    @property
    def uses_reference(self) -> bool:
        return self.method in ("dpo", "ipo")

    @property
    def scores_prompts(self) -> bool:
        """Whether the loss needs every token's successor (ORPO's NLL over the prompt too)."""
        return self.method == "orpo"

    def pair_losses(self, policy: SequenceLogps, reference: SequenceLogps | None,
                    nll_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses `[pairs]` and the per-pair values behind TRL's metrics.

        `nll_weight` (orpo): pairs / chosen targets of the step, so that the pairs' mean of
        `-nll_weight * chosen_full` is the step's NLL, a mean over the chosen targets."""
        beta, smoothing = self.beta, self.label_smoothing
        if self.method == "orpo":  # ORPOTrainer: odds ratio of length-averaged log-probs
            chosen, rejected = policy.chosen_mean, policy.rejected_mean
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            ratio = F.logsigmoid(log_odds)
            nll = -nll_weight * policy.chosen_full
            losses = nll - beta * ratio
            chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
            values = _metrics(chosen_rewards, rejected_rewards, chosen, rejected)
            values.update(zip(ORPO_METRICS, (nll.detach(), ratio.detach(), log_odds.detach()),
                              strict=True))
            return losses, values
        if self.method == "simpo":  # CPOTrainer, loss_type simpo: length-averaged log-probs
            chosen, rejected = policy.chosen_mean, policy.rejected_mean
            logits = chosen - rejected - self.simpo_gamma / beta
            losses = (-F.logsigmoid(beta * logits) * (1 - smoothing)
                      - F.logsigmoid(-beta * logits) * smoothing)
            chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
            shown = (chosen, rejected)
        else:
            assert reference is not None
            chosen_ratio = policy.chosen - reference.chosen
            rejected_ratio = policy.rejected - reference.rejected
            delta = chosen_ratio - rejected_ratio
            losses = torch.zeros_like(delta)
            for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
                losses = losses + weight * _dpo_loss(loss_type, delta, policy, reference, beta,
                                                     smoothing)
            chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
            shown = (policy.chosen, policy.rejected)
        return losses, _metrics(chosen_rewards, rejected_rewards, *shown)


def _metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
             chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ) -> dict[str, torch.Tensor]:
    """TRL's per-pair reward and log-probability values (`METRICS`)."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return dict(zip(METRICS, (
        chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
        chosen_rewards - rejected_rewards, chosen_logps.detach(), rejected_logps.detach()),
        strict=True))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, each branch where it keeps its precision (as TRL's)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _dpo_loss(loss_type: str, delta: torch.Tensor, policy: SequenceLogps,
              reference: SequenceLogps, beta: float, smoothing: float) -> torch.Tensor:
    """One of TRL's DPO losses per pair (its `reverse_kl` scores: the plain log-ratios)."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":  # TRL normalises IPO's log-ratios by the answer lengths
        chosen = (policy.chosen - reference.chosen) / policy.chosen_tokens
        rejected = (policy.rejected - reference.rejected) / policy.rejected_tokens
        return (chosen - rejected - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * smoothing)
    raise ValueError(f"unknown dpo loss type {loss_type!r}")


@dataclass
class SequenceLogps:
    """Whole-sequence log-probabilities of a micro-batch's pairs (every SP rank alike)."""

    chosen: torch.Tensor  # [pairs], summed over the answer's tokens
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # [pairs], answer lengths
    rejected_tokens: torch.Tensor
    # orpo: summed over every target of the chosen sequence, prompt included; else None
    chosen_full: torch.Tensor | None = None

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient passes through unchanged (see module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_row(local: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Per-document sums of this rank's tokens -> the whole row's, on every rank of the
    SP x TP group (each holds other tokens of the row); gradients pass through unchanged."""
    for size, group in ((state.layout.tp, state.tp_group), (state.layout.sp, state.sp_group)):
        if size > 1:
            local = _SumOverGroup.apply(local, group)
    return local


def _token_logps(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                 ) -> torch.Tensor:
    """log p(label) per token, 0 where the label is -100."""
    return -F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX,
                            reduction="none")


def chosen_targets(batch: ShardedBatch) -> int:
    """Targets of the batch's chosen sequences, prompt included: each sequence's tokens but
    its last (ORPO's NLL divides by their count over the step)."""
    bounds = batch.sp_meta.cu_host
    return sum(bounds[d + 1] - bounds[d] - 1 for d in range(0, batch.num_documents - 1, 2))


def local_document_ids(batch: ShardedBatch, state: ParallelState) -> torch.Tensor:
    """The document (index in the row) of each token this rank scores, in local order: its
    SP shard, and under TP its own contiguous part of that (the labels `tp_batch` kept).
    Built once per row: the policy and the reference pass share it."""
    return batch.sp_meta.derived(_document_ids, state.tp_rank, state.layout.tp)


def _document_ids(meta: SPMeta, tp_rank: int, tp: int) -> torch.Tensor:
    positions = slice_sequence(torch.arange(meta.total_len), meta.ctx)
    if tp > 1:
        n = positions.numel() // tp
        positions = positions[tp_rank * n : (tp_rank + 1) * n]
    bounds = torch.tensor(meta.cu_host[1:])
    return torch.searchsorted(bounds, positions.contiguous(), right=True)


def sequence_logps(head: torch.nn.Module, hidden: torch.Tensor, batch: ShardedBatch,
                   state: ParallelState, chunk_size: int | None) -> SequenceLogps:
    """Every pair's summed answer log-probabilities, from this rank's hidden states; with
    the batch's `next_tokens` (orpo), also the chosen sequences' sums over all targets."""
    answer_labels = batch.shift_labels.reshape(-1)
    # Every successor is scored when asked for; on answer tokens it is the answer label.
    scored = answer_labels if batch.next_tokens is None else batch.next_tokens.reshape(-1)
    device = hidden.device
    if state.layout.tp > 1:  # vocab-parallel over the TP group, this rank's tokens
        from longctx_cli.parallel.tensor_parallel import tp_token_losses

        token_logps = -tp_token_losses(head, hidden, scored, state, chunk_size)
    elif chunk_size is None or hidden.shape[0] <= chunk_size:
        token_logps = _token_logps(head, hidden, scored)
    else:  # one chunk's [chunk, vocab] logits at a time, in forward and in backward
        pieces = [checkpoint(_token_logps, head, hidden[s : s + chunk_size],
                             scored[s : s + chunk_size], use_reentrant=False)
                  for s in range(0, hidden.shape[0], chunk_size)]
        token_logps = torch.cat(pieces)
    docs = len(batch.sp_meta.cu_host) - 1
    ids = local_document_ids(batch, state).to(device)
    answer = (answer_labels != IGNORE_INDEX).to(token_logps)
    per_doc = [token_logps * answer, answer.detach()]
    if batch.next_tokens is not None:
        per_doc.append(token_logps)
    both = sum_over_row(torch.stack([token_logps.new_zeros(docs).index_add(0, ids, v)
                                     for v in per_doc]), state)
    sums, counts = both[0], both[1].detach()
    pairs = batch.num_documents // 2
    chosen, rejected = slice(0, 2 * pairs, 2), slice(1, 2 * pairs, 2)
    return SequenceLogps(sums[chosen], sums[rejected], counts[chosen], counts[rejected],
                         both[2][chosen] if batch.next_tokens is not None else None)


@dataclass
class PairsResult:
    loss_sum: torch.Tensor  # sum of the pair losses (the same on every SP rank)
    pairs: int
    metric_sums: dict[str, float]  # sums over the pairs of TRL's metrics


def preference_loss_sum(model: torch.nn.Module, decoder: torch.nn.Module,
                        head: torch.nn.Module, batch: ShardedBatch, config: Config,
                        state: ParallelState, objective: PreferenceLoss,
                        split: str = "train", nll_weight: float = 1.0) -> PairsResult:
    """The summed pair losses of one micro-batch (the caller divides by the step's pairs);
    `split` names the rows `batch.rows` index, for a precomputed reference; `nll_weight`:
    see `PreferenceLoss.pair_losses`."""
    chunk = config.memory.loss_chunk_size if config.memory.chunked_loss else None
    policy = sequence_logps(head, sp_hidden_states(decoder, batch), batch, state, chunk)
    reference = None
    if objective.uses_reference and objective.precomputed:
        assert objective.table is not None, "the reference table is computed before training"
        reference = objective.table.lookup(split, batch.rows, policy)
    elif objective.uses_reference:
        with torch.no_grad(), reference_model(model):
            reference = sequence_logps(head, sp_hidden_states(decoder, batch), batch, state,
                                       chunk)
    losses, values = objective.pair_losses(policy, reference, nll_weight)
    return PairsResult(losses.sum(), int(losses.numel()),
                       {k: float(v.sum()) for k, v in values.items()})


def reference_model(model: torch.nn.Module) -> AbstractContextManager:
    """A context in which `model` computes the reference: its adapter switched off."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:  # the config rules refuse this; never compare the policy with itself
        raise RuntimeError("a reference model needs an adapter to switch off")
    return disable()


# ---- precomputed reference log-probabilities ------------------------------------------


@dataclass
class ReferenceTable:
    """Every pair's (chosen, rejected) reference log-probabilities, per split and row."""

    rows: dict[str, dict[int, torch.Tensor]]  # split -> row -> [pairs in the row, 2]

    def lookup(self, split: str, rows: tuple[int, ...], policy: SequenceLogps) -> SequenceLogps:
        both = torch.cat([self.rows[split][r] for r in rows]).to(policy.chosen)
        return SequenceLogps(both[:, 0], both[:, 1], policy.chosen_tokens,
                             policy.rejected_tokens)


def _fingerprint(splits: dict[str, Dataset], config: Config) -> dict:
    """What the table depends on: the model, and the rows: their files in the prepared-data
    cache (whose folder is named by the fingerprint of every input to the rows) and counts."""
    return {"model": config.model.base_model or repr(config.model.model_config_dict),
            "seed": config.training.seed if config.model.random_init else None,
            "lora_model_dir": config.lora.lora_model_dir,
            "rows": {k: (sorted(f["filename"] for f in v.cache_files), len(v))
                     for k, v in splits.items()}}


@torch.no_grad()
def reference_table(model: torch.nn.Module, splits: dict[str, Dataset], config: Config,
                    state: ParallelState, pad_id: int, objective: PreferenceLoss,
                    say) -> PreferenceLoss:
    """`objective` with its reference table: read from `output_dir` when it was computed for
    these rows and this model (a resumed run must not recompute it from trained weights),
    else computed now, before any training, from the initial weights, and saved."""
    if not (objective.uses_reference and objective.precomputed):
        return objective
    path = Path(config.output.output_dir) / REFERENCE_FILE
    fingerprint = _fingerprint(splits, config)
    found = [None]  # rank 0 decides for every rank: they must all compute, or none
    if dist.get_rank() == 0 and path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("fingerprint") == fingerprint:
            found = [saved["rows"]]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        say(f"reference log-probabilities: read from {path}")
        return replace(objective, table=ReferenceTable(found[0]))
    decoder, head = decoder_and_head(model)
    chunk = config.memory.loss_chunk_size if config.memory.chunked_loss else None
    started = time.perf_counter()
    mine: dict[str, dict[int, torch.Tensor]] = {}
    for split, rows in splits.items():
        mine[split] = {}
        for index in range(state.dp_rank, len(rows), state.layout.dp):
            batch = row_batch(rows, index, state, pad_id)
            logps = sequence_logps(head, sp_hidden_states(decoder, batch), batch, state, chunk)
            mine[split][index] = torch.stack([logps.chosen, logps.rejected], 1).double().cpu()
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    table = {split: {i: t for part in gathered for i, t in part[split].items()}
             for split in splits}
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"fingerprint": fingerprint, "rows": table}, tmp)
        tmp.replace(path)
    count = sum(len(t) for t in table.values())
    say(f"reference log-probabilities: {count} rows through the initial model in "
        f"{time.perf_counter() - started:.1f}s, saved to {path}")
    return replace(objective, table=ReferenceTable(table))

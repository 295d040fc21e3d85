"""Evaluation during training: when (Axolotl's eval cadence), the token-weighted eval loss
over the held-out rows (a preference run: the pair-weighted loss and TRL's metrics over the
held-out pairs), and the `reduce_lr_on_plateau` schedule that steps on it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from longctx_cli.config import Config
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.runtime.batches import row_batch
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.model import decoder_and_head
from longctx_cli.train.objectives.causal_lm import forward_loss_sum
from longctx_cli.train.optim import is_plateau
from longctx_cli.train.preference import PreferenceLoss, chosen_targets, preference_loss_sum
from longctx_cli.train.schedule import interval


def eval_interval(config: Config, steps_per_epoch: int, num_steps: int) -> int | None:
    return interval(config.eval.eval_steps, config.eval.evals_per_epoch, config.eval.eval_strategy,
                    steps_per_epoch, num_steps)


def rank_rows(count: int, state: ParallelState) -> list[tuple[int, bool]]:
    """(row, real) this DP rank evaluates: every rank runs the same number of forwards, a
    rank past the end repeats row 0 and counts nothing (it keeps the collectives in step)."""
    return [(index, True) if index < count else (0, False)
            for index in range(state.dp_rank, math.ceil(count / state.layout.dp)
                               * state.layout.dp, state.layout.dp)]


@torch.no_grad()
def evaluate_loss(decoder: torch.nn.Module, lm_head: torch.nn.Module, rows, config: Config,
                  state: ParallelState, pad_id: int) -> float:
    """Token-weighted eval loss over all ranks; every rank runs the same number of forwards."""
    loss_sum, count = 0.0, 0
    for index, real in rank_rows(len(rows), state):
        batch = row_batch(rows, index, state, pad_id, whole_rows=config.objective.whole_rows)
        if not real:  # keep collectives in step, contribute nothing
            batch.shift_labels.fill_(IGNORE_INDEX)
        loss_sum += forward_loss_sum(decoder, lm_head, batch, config, state).item()
        count += valid_token_count(batch.shift_labels)
    total_loss, total_count = all_reduce_sum([loss_sum, count], state.device)
    return total_loss / total_count if total_count else float("nan")


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, rows, config: Config, state: ParallelState,
                   pad_id: int, objective: PreferenceLoss) -> tuple[float, dict[str, float]]:
    """Pair-weighted eval loss and TRL's metrics (as `eval_<name>`) over the held-out pairs."""
    decoder, lm_head = decoder_and_head(model)
    counted = state.sp_rank == 0 and state.tp_rank == 0  # alike on its SP x TP group
    sums: dict[str, float] = {"loss": 0.0, "pairs": 0.0}
    nll_weight = 1.0
    if objective.scores_prompts:  # orpo: the NLL is a mean over all held-out chosen targets
        pairs = chosen = 0
        for index, real in rank_rows(len(rows), state):
            if real and counted:
                batch = row_batch(rows, index, state, pad_id)
                pairs, chosen = pairs + batch.num_documents // 2, chosen + chosen_targets(batch)
        pairs, chosen = all_reduce_sum([pairs, chosen], state.device)
        nll_weight = pairs / chosen if chosen else 1.0
    for index, real in rank_rows(len(rows), state):
        batch = row_batch(rows, index, state, pad_id, objective.scores_prompts)
        result = preference_loss_sum(model, decoder, lm_head, batch, config, state, objective,
                                     split="eval", nll_weight=nll_weight)
        for key, value in {"loss": result.loss_sum.item(), "pairs": result.pairs,
                           **result.metric_sums}.items():
            sums[key] = sums.get(key, 0.0) + value * (real and counted)
    totals = dict(zip(sums, all_reduce_sum(list(sums.values()), state.device), strict=True))
    pairs = totals.pop("pairs")
    loss = totals.pop("loss") / pairs if pairs else float("nan")
    return loss, {f"eval_{k}": v / pairs for k, v in totals.items()} if pairs else {}


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode (no attention or residual dropout), each module's own mode
    restored after (a frozen tower may stay in eval)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


class Evaluator:
    """Evaluates every `eval_interval` steps when the run has eval rows (`val_set_size`)."""

    def __init__(self, config: Config, state: ParallelState, model: torch.nn.Module,
                 preference: PreferenceLoss | None, rows, pad_id: int, scheduler,
                 steps_per_epoch: int, num_steps: int):
        self.config, self.state, self.pad_id = config, state, pad_id
        self.model, self.preference, self.rows = model, preference, rows
        self.decoder, self.lm_head = decoder_and_head(model, config.trains_images)
        self.scheduler = scheduler
        self.every = eval_interval(config, steps_per_epoch, num_steps)
        self.metrics: dict[str, float] = {}  # the last evaluation's extra metrics

    def maybe_eval(self, step: int) -> float | None:
        """The eval loss after optimizer step `step` (0-based) if it is an eval step, else
        None; a plateau schedule steps on it (every rank evaluates: it is a collective)."""
        self.metrics = {}
        if not self.every or self.rows is None or (step + 1) % self.every:
            return None
        with evaluation_mode(self.model):  # as Hugging Face evaluates: no dropout
            if self.preference is not None:
                eval_loss, self.metrics = evaluate_pairs(self.model, self.rows, self.config,
                                                         self.state, self.pad_id,
                                                         self.preference)
            else:
                eval_loss = evaluate_loss(self.decoder, self.lm_head, self.rows, self.config,
                                          self.state, self.pad_id)
        if is_plateau(self.config):
            self.scheduler.step(eval_loss)
        return eval_loss

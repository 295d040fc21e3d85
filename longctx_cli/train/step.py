"""One optimizer step: forward and backward over the step's micro-batches, one gradient sync,
clip, and the optimizer update (or a skip when something is NaN/inf).

The loss of a step is the single-device mean over every valid target token of the step: each
rank sums CE over its own shard, the divisor is the exact valid-token count over the SP
group, the DP group and the accumulation window, and gradients are summed over the ranks
holding the same parameters. A preference run (`rl:`) divides its summed pair losses by the
step's pair count instead (`train/preference.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.runtime.loss import lm_loss_sum, valid_token_count
from longctx_cli.runtime.memory_savers import activation_offload
from longctx_cli.runtime.model import sp_hidden_states
from longctx_cli.train.precision import Precision
from longctx_cli.train.preference import (
    PreferenceLoss,
    chosen_targets,
    preference_loss_sum,
)


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: float
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)  # a preference run's TRL metrics
    shown: tuple[str, ...] | None = None  # the metrics the step line shows (None: all)


class NonFiniteError(Exception):
    """The step's loss or gradient is NaN/inf under `on_nonfinite: stop`; `what` names it."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def forward_loss_sum(decoder, lm_head, batch: ShardedBatch, config: Config,
                     state: ParallelState) -> torch.Tensor:
    """Summed CE of this rank's shard of one micro-batch (the caller divides)."""
    hidden = sp_hidden_states(decoder, batch)
    chunk = config.memory.loss_chunk_size if config.memory.chunked_loss else None
    if state.layout.tp > 1:  # vocab-parallel CE over the TP group
        from longctx_cli.parallel.tensor_parallel import tp_loss_sum

        return tp_loss_sum(lm_head, hidden, batch.shift_labels, state, chunk)
    return lm_loss_sum(lm_head, hidden, batch.shift_labels, chunk)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """World sums of a few scalars, in float64 so token counts stay exact."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def sum_gradients(params: list[torch.nn.Parameter], state: ParallelState) -> None:
    """Sum gradients over the ranks holding the same parameters (the loss is pre-divided),
    one flat buffer per dtype; under TP, DTensor's partial sums over the TP group first."""
    if state.layout.tp > 1:
        from longctx_cli.parallel.tensor_parallel import finish_partial_gradients

        finish_partial_gradients(params)
    if state.replica_group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=state.replica_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def nonfinite_ranks(local_value: float, device: torch.device) -> list[int]:
    """Ranks whose local value is NaN/inf (a collective: every rank calls it)."""
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(not math.isfinite(local_value))
    dist.all_reduce(flags)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def first_nonfinite_grad(model: torch.nn.Module) -> str | None:
    """Name of the first parameter whose (local part of the) gradient is NaN or infinite."""
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2 shards
        if not bool(torch.isfinite(local).all()):
            return name
    return None


def apply_update(model: torch.nn.Module, params: list[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, config: Config, state: ParallelState,
                 use_fsdp: bool, precision: Precision, local_loss: float,
                 ) -> tuple[float, float, bool]:
    """After the step's backward passes: the one gradient sync, the NaN/inf check, clipping
    and the optimizer update (or a skip). `local_loss`: this rank's share of the loss, as
    counted once per replica. Returns (the world's loss sum, grad norm, skipped); raises
    NonFiniteError under `on_nonfinite: stop`."""
    device = state.device
    # The one gradient sync: FSDP2's own reduce-scatter did it in backward, else sum here.
    if not use_fsdp:
        sum_gradients(params, state)
    bad = nonfinite_ranks(local_loss, device)
    (loss_sum_global,) = all_reduce_sum([local_loss], device)
    clip = config.training.max_grad_norm
    max_norm = clip if clip is not None else float("inf")
    precision.unscale(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = bool(bad) or not math.isfinite(grad_norm)
    if skipped and config.training.on_nonfinite == "stop" and not (
        not bad and precision.overflowed(grad_norm)  # fp16 loss scaling backs off instead
    ):
        if bad:
            raise NonFiniteError(f"the loss on rank(s) {bad}")
        name = first_nonfinite_grad(model)
        raise NonFiniteError(f"the gradient of `{name}`" if name else "the gradient norm")
    if not skipped:
        precision.step(optimizer)
    precision.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum_global, grad_norm, skipped


def train_step(
    model: torch.nn.Module, decoder: torch.nn.Module, lm_head: torch.nn.Module,
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
    batches: list[ShardedBatch], config: Config, state: ParallelState, use_fsdp: bool,
    precision: Precision | None = None, preference: PreferenceLoss | None = None,
) -> StepResult:
    """One optimizer step over `batches` (this rank's micro-batches of the step); raises
    NonFiniteError under `on_nonfinite: stop`, else skips the update of a bad step."""
    device = state.device
    precision = precision or Precision(device.type)
    local_count = sum(valid_token_count(b.shift_labels) for b in batches)
    # A pair's loss is the same on every rank of its SP group: count it (and report it) once.
    counts_pairs = preference is not None and state.sp_rank == 0 and state.tp_rank == 0
    local_pairs = sum(b.num_documents // 2 for b in batches) if counts_pairs else 0
    scores_prompts = preference is not None and preference.scores_prompts
    local_chosen = sum(map(chosen_targets, batches)) if counts_pairs and scores_prompts else 0
    global_count, global_pairs, global_chosen = all_reduce_sum(
        [local_count, local_pairs, local_chosen], device)
    divisor = max(global_pairs if preference is not None else global_count, 1.0)
    # orpo: the pairs' mean of the NLL shares must be the mean over the step's chosen targets.
    nll_weight = global_pairs / global_chosen if global_chosen else 1.0
    # FSDP2 averages gradients over its mesh (the world, or dp x cp with TP, whose own sums
    # DTensor does); the loss is already normalised by the global token count, so scale it
    # up to turn that average into the sum we need.
    replicas = dist.get_world_size() // state.layout.tp
    backward_divisor = divisor / replicas if use_fsdp else divisor
    local_loss = 0.0
    metric_sums: dict[str, float] = {}
    for i, batch in enumerate(batches):
        if use_fsdp:
            # Reduce-scatter only after the last micro-batch of the window.
            model.set_requires_gradient_sync(i == len(batches) - 1)
        with activation_offload(config.memory.activation_offloading):
            with precision.autocast():
                if preference is None:
                    loss_sum = forward_loss_sum(decoder, lm_head, batch, config, state)
                else:
                    pairs = preference_loss_sum(model, decoder, lm_head, batch, config, state,
                                                preference, nll_weight=nll_weight)
                    loss_sum = pairs.loss_sum
                    for key, value in pairs.metric_sums.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + value * counts_pairs
            precision.scale(loss_sum / backward_divisor).backward()
        local_loss += loss_sum.item() * (counts_pairs or preference is None)
    loss_sum_global, grad_norm, skipped = apply_update(model, params, optimizer, config, state,
                                                       use_fsdp, precision, local_loss)
    metrics = {}
    if preference is not None:
        sums = all_reduce_sum(list(metric_sums.values()), device) if metric_sums else []
        metrics = {k: v / divisor for k, v in zip(metric_sums, sums, strict=True)}
    return StepResult(loss_sum_global / divisor, int(global_count), grad_norm, skipped, metrics)


class RowSteps:
    """The optimizer steps of a run on prepared rows (SFT, preference): each step reads its
    rows (`DataPosition`) and runs `train_step` (`rl: grpo` runs `rollout.GrpoSteps`)."""

    def __init__(self, config: Config, state: ParallelState, data, pad_id: int,
                 model: torch.nn.Module, decoder: torch.nn.Module, lm_head: torch.nn.Module,
                 preference: PreferenceLoss | None):
        self.config, self.state, self.data, self.pad_id = config, state, data, pad_id
        self.model, self.decoder, self.lm_head = model, decoder, lm_head
        self.preference = preference

    def step(self, step: int, params: list[torch.nn.Parameter],
             optimizer: torch.optim.Optimizer, use_fsdp: bool,
             precision: Precision) -> StepResult:
        from longctx_cli.runtime.batches import micro_batches

        batches = micro_batches(*self.data.step_rows(step), self.config, self.state,
                                self.pad_id)
        return train_step(self.model, self.decoder, self.lm_head, params, optimizer, batches,
                          self.config, self.state, use_fsdp, precision, self.preference)

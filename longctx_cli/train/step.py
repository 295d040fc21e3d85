"""One optimizer step, whatever the objective (`train/objectives/`): forward and backward over
the step's micro-batches, one gradient sync, clip, and the optimizer update (or a skip when
something is NaN/inf).

The objective hands over its micro-batches, each one's summed loss and the step's divisor (the
step's valid tokens over the SP group, the DP group and the accumulation window; a
preference run's pairs; 1 for GRPO, whose losses are already shares); each micro-batch's
backward is of its loss over that divisor, and gradients are summed over the ranks holding
the same parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.constants import GRAD_BUCKET_BYTES
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.runtime.distributed import all_reduce_sum
from longctx_cli.runtime.memory_savers import activation_offload
from longctx_cli.train.objectives import Objective
from longctx_cli.train.objectives.causal_lm import CausalLm
from longctx_cli.train.objectives.preference import Preference
from longctx_cli.train.precision import Precision
from longctx_cli.train.preference import PreferenceLoss


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: float
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's (TRL's names)
    shown: tuple[str, ...] | None = None  # the metrics the step line shows (None: all)


class NonFiniteError(Exception):
    """The step's loss or gradient is NaN/inf under `on_nonfinite: stop`; `what` names it."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def sum_gradients(params: list[torch.nn.Parameter], state: ParallelState,
                  bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum gradients over the ranks holding the same parameters (the loss is pre-divided), in
    buckets of one dtype of at most `bucket_bytes`; under TP, DTensor's partial sums over the
    TP group first."""
    if state.layout.tp > 1:
        from longctx_cli.parallel.tensor_parallel import finish_partial_gradients

        finish_partial_gradients(params)
    if state.replica_group is None:
        return
    for bucket in gradient_buckets(params, bucket_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous():  # summed where it is
            dist.all_reduce(bucket[0], group=state.replica_group)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=state.replica_group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def gradient_buckets(params: list[torch.nn.Parameter],
                     limit: int = GRAD_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """The parameters' local gradients in order, grouped by dtype into buckets of at most
    `limit` bytes (a gradient larger than that alone in its bucket)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        size = grad.numel() * grad.element_size()
        bucket, filled = open_bucket.get(grad.dtype, ([], 0))
        if bucket and filled + size > limit:
            buckets.append(bucket)
            bucket, filled = [], 0
        bucket.append(grad)
        open_bucket[grad.dtype] = (bucket, filled + size)
    buckets.extend(bucket for bucket, _ in open_bucket.values() if bucket)
    return buckets


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


def optimizer_step(objective: Objective, batches: list, model: torch.nn.Module,
                   params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   config: Config, state: ParallelState, use_fsdp: bool,
                   precision: Precision) -> StepResult:
    """One optimizer step of `objective` over `batches` (this rank's micro-batches of the
    step); raises NonFiniteError under `on_nonfinite: stop`, else skips the update of a bad
    step."""
    counts = objective.counts(batches)
    # FSDP2 averages gradients over its mesh (the world, or dp x cp with TP, whose own sums
    # DTensor does); the loss is already the share of the step's, so scale it up by the
    # replicas to turn that average into the sum we need.
    replicas = dist.get_world_size() // state.layout.tp if use_fsdp else 1
    local_loss = 0.0
    values: list[dict] = []
    for i, batch in enumerate(batches):
        if use_fsdp:
            # Reduce-scatter only after the last micro-batch of the window.
            model.set_requires_gradient_sync(i == len(batches) - 1)
        with activation_offload(config.memory.activation_offloading):
            with precision.autocast():
                share = objective.loss_share(batch, counts)
            loss = share.loss_sum / counts.divisor
            precision.scale(loss * replicas if use_fsdp else loss).backward()
        local_loss += share.reported
        values.append(share.metrics)
    loss_sum_global, grad_norm, skipped = apply_update(model, params, optimizer, config, state,
                                                       use_fsdp, precision, local_loss)
    return StepResult(loss_sum_global / counts.divisor, counts.tokens, grad_norm, skipped,
                      objective.step_metrics(values, counts), objective.shown)


def train_step(
    model: torch.nn.Module, decoder: torch.nn.Module, lm_head: torch.nn.Module,
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
    batches: list[ShardedBatch], config: Config, state: ParallelState, use_fsdp: bool,
    precision: Precision | None = None, preference: PreferenceLoss | None = None,
) -> StepResult:
    """`optimizer_step` of the causal-LM (or, with `preference`, the preference) objective
    over batches the caller built (the tests, the family matrix)."""
    objective: Objective = (CausalLm(config, state, decoder, lm_head) if preference is None
                            else Preference(config, state, model, decoder, lm_head, preference))
    return optimizer_step(objective, batches, model, params, optimizer, config, state,
                          use_fsdp, precision or Precision(state.device.type))

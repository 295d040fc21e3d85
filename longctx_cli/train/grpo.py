"""GRPO-family losses on rollout rows sharded over an SP group (TRL's `GRPOTrainer`).

A rollout row holds whole prompt groups: each prompt once, its first completion after it,
every other completion a branch document that sees the prompt and itself (the row layout of
`prefix_sharing`, with `num_generations` branches instead of one; `rollout.group_row`). Every
document is one completion, its targets the completion's tokens.

Each rank scores the targets of its own shard through the head in blocks, with the logits
divided by the sampling temperature (as TRL scores them): the log-probability of each target
and the entropy of its distribution; no rank ever holds the row's `[tokens, vocab]` logits.
The per-token terms of TRL's `_compute_loss` (importance ratio against the rollout's log-
probabilities, clipping, k3 KL to the reference) are computed on the rank's own tokens and
summed per completion; summing those over the SP (and TP) group with the gradient passed
through (`preference.sum_over_row`) gives every rank the completions' sums, from which it
computes the same loss; the backward of each rank then reaches only its own tokens, and the
step's gradient sync adds the shares up to the single-device gradient. Sequence-level
importance sampling (GSPO) sums the log-ratios per completion the same way first.

Loss aggregation is TRL's for one optimizer step of `M` micro-batches of `B` completions each
(a micro-batch is TRL's `per_device_train_batch_size`, one process's share; its processes
are longctx's DP ranks): `grpo`/`sapo` average each completion's token mean, `bnpo` the
micro-batch's token mean, `dr_grpo` divides by `B * max_completion_length`, `luspo` averages
the completions' sums, each then averaged over the `M` micro-batches; `dapo`/`cispo`/`vespo`
divide by the step's share of the generation batch's completion tokens (`step_tokens_of`).
Every DP rank's loss is its share of the step's: the gradient sync sums them, which is TRL's
average over processes of their accumulated losses.

`top_entropy_quantile` keeps in the policy term only the tokens whose entropy reaches the
quantile of the micro-batch's scored tokens over every process (TRL gathers them over its
processes): the per-token entropies (one float each) are gathered over the SP and DP ranks.
`entropy_coef` subtracts the micro-batch's mean entropy (with gradient) times the coefficient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch
from longctx_cli.train.preference import local_document_ids, sum_over_row

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# Ratio-clipped losses (TRL logs their clip ratios).
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Losses divided by the step's tokens (TRL: `num_items_in_batch`), not by the accumulation.
_TOKEN_NORMALISED = ("dapo", "cispo", "vespo")
_MEAN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean", "cispo_clip_ratio")
# GrpoLoss fields whose `trl:` key has another name.
_TRL_KEYS = {"epsilon_low": "epsilon", "epsilon_high": "epsilon_upper"}
# VESPO's clamp of the summed log-ratio from below: log(1e-8), as the paper's code.
_VESPO_LOG_FLOOR = math.log(1e-8)


@dataclass(frozen=True)
class GrpoLoss:
    """TRL's GRPO loss settings (the `trl:` keys of a `rl: grpo` run)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None

    @classmethod
    def from_trl(cls, trl: Any) -> GrpoLoss:
        """The loss settings of a run's `trl:` section (`config.TrlConfig`): each field is the
        section's key of its name (`_TRL_KEYS` where TRL names it otherwise)."""
        return cls(**{f.name: getattr(trl, _TRL_KEYS.get(f.name, f.name)) for f in fields(cls)})

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads the per-token entropy (not only the metric)."""
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    def completion_weights(self, tokens: torch.Tensor, micro_batches: int,
                           step_tokens: float) -> torch.Tensor:
        """The weight of each completion's summed token losses in the step's loss:
        `tokens` `[completions]` counts each completion's scored tokens (one micro-batch);
        `micro_batches` and `step_tokens`: the step's (every DP rank's) micro-batches and
        scored tokens."""
        count = tokens.numel()
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / (micro_batches * count * tokens.clamp(min=1.0))
        if self.loss_type == "bnpo":
            return torch.full_like(tokens, 1.0 / (micro_batches * max(float(tokens.sum()), 1.0)))
        if self.loss_type == "dr_grpo":
            return torch.full_like(tokens, 1.0 / (micro_batches * count
                                                  * self.max_completion_length))
        if self.loss_type == "luspo":
            return torch.full_like(tokens, 1.0 / (micro_batches * count))
        return torch.full_like(tokens, 1.0 / max(step_tokens, 1.0))  # dapo, cispo, vespo

    def vespo_weights(self, log_ratio_sums: torch.Tensor, advantages: torch.Tensor,
                      ) -> torch.Tensor:
        """VESPO's gamma weight of each completion, `e^lam w^k e^(-lam w)` of its summed
        log-ratio `log w` (clamped), `k`/`lam` by the advantage's sign; no gradient."""
        log_w = log_ratio_sums.detach().clamp(_VESPO_LOG_FLOOR, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, self.vespo_k_pos, self.vespo_k_neg)
        lam = torch.where(positive, self.vespo_lambda_pos, self.vespo_lambda_neg).clamp(
            min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(
            nan=0.0, posinf=0.0, neginf=0.0)

    def policy_terms(self, coef: torch.Tensor, advantages: torch.Tensor,
                     logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the policy loss of each token, or of each sequence, the ratio after `delta`):
        `coef` the importance ratio, `advantages` alike in shape, `logps` the scored
        log-probabilities (cispo multiplies them; a sequence-level cispo passes their sums)."""
        if self.loss_type == "cispo":
            clamped = coef.clamp(max=self.epsilon_high).detach()
            return -clamped * advantages * logps, coef
        if self.loss_type == "sapo":
            temps = torch.where(advantages > 0, self.sapo_temperature_pos,
                                self.sapo_temperature_neg)
            return -torch.sigmoid(temps * (coef - 1)) * 4 / temps * advantages, coef
        clipped = coef.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        if self.delta is not None:
            coef = coef.clamp(max=self.delta)
        return -torch.min(coef * advantages, clipped * advantages), coef


@dataclass
class RolloutBatch:
    """One micro-batch of rollouts: the sharded row and what each completion carries."""

    batch: ShardedBatch
    advantages: torch.Tensor  # [documents] float32 (0 on the padding tail)
    tokens: torch.Tensor  # [documents] scored tokens of each completion (after masking)
    completions: int  # B: the completions in the row
    old_logps: torch.Tensor | None = None  # this rank's scored tokens, rollout-time policy
    ref_logps: torch.Tensor | None = None  # this rank's scored tokens, reference model


@dataclass
class GrpoResult:
    loss: torch.Tensor  # this micro-batch's share of the step loss (alike on the SP group)
    metric_sums: dict[str, tuple[float, float]]  # name -> (numerator, denominator)
    extremes: dict[str, float]  # clip_ratio/low_min and /high_max over the completions


class _ScaledHead(torch.nn.Module):
    """The model's head with its logits divided by the sampling temperature (TRL's scoring)."""

    def __init__(self, head: torch.nn.Module, temperature: float):
        super().__init__()
        self.head, self.temperature = head, temperature

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden) / self.temperature


def _scored_block(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of each token of a block; the entropy with gradient only when
    the loss uses it (the entropy bonus)."""
    logits = head(hidden).float()
    lse = logits.logsumexp(-1)
    logps = logits.gather(1, targets.clamp(min=0)[:, None])[:, 0] - lse
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logps, entropy


def score_tokens(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                 state: ParallelState, chunk_size: int | None, temperature: float,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each local token's log-probability of its target (with gradient) and entropy (None
    under TP; with gradient if `entropy_grad`), the logits divided by `temperature`, a block
    of tokens at a time."""
    scaled = _ScaledHead(head, temperature)
    if state.layout.tp > 1:  # vocab-parallel over the TP group
        from longctx_cli.parallel.tensor_parallel import tp_token_losses

        return -tp_token_losses(scaled, hidden, targets, state, chunk_size), None
    if chunk_size is None or hidden.shape[0] <= chunk_size:
        return _scored_block(scaled, hidden, targets, entropy_grad)
    pieces = [checkpoint(_scored_block, scaled, hidden[s : s + chunk_size],
                         targets[s : s + chunk_size], entropy_grad, use_reentrant=False)
              for s in range(0, hidden.shape[0], chunk_size)]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def step_tokens_of(generation_tokens: float, gradient_accumulation_steps: int,
                   steps_per_generation: int) -> float:
    """The `step_tokens` of `grpo_loss` for dapo/cispo/vespo: TRL divides each micro-batch's
    token sum by the generation batch's scored tokens (every process's) scaled to one
    accumulation window, `tokens x accumulation / steps_per_generation`."""
    return generation_tokens * gradient_accumulation_steps / steps_per_generation


def _gathered(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The 1-D tensors of every rank of `group` (lengths may differ), concatenated."""
    if group is None:
        return local
    size = dist.get_world_size(group)
    count = torch.tensor([local.numel()], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    lengths = [int(c) for c in counts]
    padded = local.new_zeros(max(lengths))
    padded[:local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, lengths, strict=True)])


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """`torch.quantile(values, q)` (linear interpolation), also past its input-size limit."""
    if values.numel() <= 1 << 24:
        return torch.quantile(values, q)
    ordered = values.sort().values
    rank = torch.tensor(q, dtype=values.dtype) * (values.numel() - 1)
    below = int(rank)
    above = min(below + 1, values.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], rank - below)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      state: ParallelState) -> torch.Tensor:
    """1 on the scored tokens whose entropy reaches the `1 - quantile` quantile of every
    rank's scored tokens of this micro-batch (the row's, over SP, and every DP rank's, as
    TRL's over its processes), else 0."""
    scored = mask.bool()
    group = state.replica_group if dist.is_available() and dist.is_initialized() else None
    everyone = _gathered(entropy.detach()[scored].float(), group)
    if everyone.numel() == 0:
        return torch.zeros_like(mask)
    threshold = _quantile(everyone, 1.0 - quantile)
    return ((entropy.detach() >= threshold) & scored).to(mask)


def grpo_loss(head: torch.nn.Module, hidden: torch.Tensor, rollout: RolloutBatch,
              objective: GrpoLoss, state: ParallelState, chunk_size: int | None,
              micro_batches: int = 1, step_tokens: float | None = None) -> GrpoResult:
    """This micro-batch's share of the step's GRPO loss and TRL's metrics, from this rank's
    hidden states (see the module doc). `micro_batches`: the step's micro-batches over every
    DP rank; `step_tokens` (dapo/cispo/vespo): `step_tokens_of` the generation batch's
    scored tokens, every DP rank's (default: this micro-batch's)."""
    batch = rollout.batch
    targets = batch.shift_labels.reshape(-1)
    logps, entropy = score_tokens(head, hidden, targets, state, chunk_size,
                                  objective.temperature, objective.entropy_coef != 0.0)
    if objective.needs_entropy and entropy is None:
        raise ValueError("top_entropy_quantile and entropy_coef need per-token entropies, "
                         "which the vocab-parallel (TP) head does not compute")
    mask = (targets != IGNORE_INDEX).to(logps)
    ids = local_document_ids(batch, state).to(logps.device)
    docs = rollout.advantages.numel()
    b = rollout.completions

    def per_document(*values: torch.Tensor) -> torch.Tensor:
        return sum_over_row(torch.stack([mask.new_zeros(docs).index_add(0, ids, v * mask)
                                         for v in values]), state)

    old = rollout.old_logps if rollout.old_logps is not None else logps.detach()
    log_ratio = logps - old
    advantages = rollout.advantages.to(logps)
    token_advantages = advantages[ids]
    tokens = rollout.tokens.to(logps)
    # TRL masks only the policy term to the high-entropy tokens (not the KL, not the counts).
    selected = (high_entropy_mask(entropy, mask, objective.top_entropy_quantile, state)
                if objective.top_entropy_quantile < 1.0 else None)
    kl = None
    if objective.beta != 0.0:
        assert rollout.ref_logps is not None, "beta != 0 needs the reference log-probabilities"
        diff = rollout.ref_logps - logps
        kl = torch.exp(diff) - diff - 1
    keep = None  # DeepSeek-V3.2's off-policy sequence mask: 1 keeps a completion's policy term
    if objective.off_policy_mask_threshold is not None:
        drift = per_document((old - logps).detach())[0] / tokens.clamp(min=1.0)
        keep = ((advantages >= 0) | (drift <= objective.off_policy_mask_threshold)).to(logps)
    phi = None
    if objective.loss_type == "vespo":  # a weight per completion from its summed log-ratio
        phi = objective.vespo_weights(per_document(log_ratio.detach().clamp(-20.0, 20.0))[0],
                                      advantages)
    if objective.importance_sampling_level == "token":
        coef = torch.exp(log_ratio)
        if kl is not None and objective.use_bias_correction_kl:
            kl = kl * coef
        if phi is not None:
            policy = -phi[ids] * token_advantages * logps
        else:
            policy, coef = objective.policy_terms(coef, token_advantages, logps)
        if keep is not None:
            policy = policy * keep[ids]
        if selected is not None:
            policy = policy * selected
        per_token = policy if kl is None else policy + objective.beta * kl
        sums = per_document(per_token)[0]
        token_coef = coef
    else:  # GSPO: one ratio per completion, the mean of its tokens' log-ratios
        kept_logps = logps if selected is None else logps * selected
        wanted = [log_ratio, kept_logps] + ([selected] if selected is not None else []) + (
            [kl] if kl is not None else [])
        sums_all = per_document(*wanted)
        seq_coef = torch.exp(sums_all[0] / tokens.clamp(min=1.0))
        kept = sums_all[2] if selected is not None else tokens  # tokens the policy term keeps
        if phi is not None:  # VESPO's term stays per token: -phi A log p
            sums, seq_coef_clamped = -phi * advantages * sums_all[1], seq_coef
        else:
            policy, seq_coef_clamped = objective.policy_terms(seq_coef, advantages, sums_all[1])
            sums = policy if objective.loss_type == "cispo" else policy * kept
        if keep is not None:
            sums = sums * keep
        if kl is not None:
            seq_kl = sums_all[-1] * (seq_coef if objective.use_bias_correction_kl else 1.0)
            sums = sums + objective.beta * seq_kl
            kl = kl * (seq_coef[ids].detach() if objective.use_bias_correction_kl else 1.0)
        token_coef = seq_coef_clamped
    weights = objective.completion_weights(
        tokens[:b], micro_batches, float(tokens[:b].sum()) if step_tokens is None else step_tokens)
    loss = (sums[:b] * weights).sum()
    metrics, extremes = _metrics(objective, token_coef, advantages, token_advantages, kl,
                                 entropy, mask, ids, tokens, b, per_document)
    if phi is not None:
        metrics["vespo/phi_seq_mean"] = (float(phi[:b].sum()), float(b))
    if objective.entropy_coef != 0.0:
        # TRL: minus coef x the micro-batch's mean entropy (over the kept tokens) per
        # accumulation step, averaged over processes; the DP sum of gradients is the average
        # once each rank divides by the step's micro-batches of every rank.
        kept = mask if selected is None else selected
        totals = sum_over_row(torch.stack([(entropy * kept).sum(), kept.sum()]), state)
        bonus = objective.entropy_coef * totals[0] / totals[1].clamp(min=1.0) / micro_batches
        # TRL's `policy_loss`: this micro-batch's loss before the bonus, as one process sees it
        # (the token-normalised losses are not divided by the accumulation).
        scale = state.layout.dp * (1 if objective.loss_type in _TOKEN_NORMALISED
                                   else micro_batches // state.layout.dp)
        metrics["policy_loss"] = (float(loss.detach()) * scale, 1.0)
        metrics["entropy_coef"] = (objective.entropy_coef, 1.0)
        loss = loss - bonus
    return GrpoResult(loss, metrics, extremes)


@torch.no_grad()
def _metrics(objective: GrpoLoss, coef: torch.Tensor, advantages: torch.Tensor,
             token_advantages: torch.Tensor, kl: torch.Tensor | None,
             entropy: torch.Tensor | None, mask: torch.Tensor, ids: torch.Tensor,
             tokens: torch.Tensor, completions: int, per_document,
             ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """TRL's loss metrics as (numerator, denominator) over this micro-batch (token means, or
    completion means for sequence-level ratios) and the clip ratios' extremes."""
    sequence_level = coef.shape != mask.shape
    adv = advantages if sequence_level else token_advantages
    flags: dict[str, torch.Tensor] = {}
    if objective.loss_type in _CLIPPED:
        low = (coef < 1 - objective.epsilon_low) & (adv < 0)
        high = (coef > 1 + objective.epsilon_high) & (adv > 0)
        flags = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                 "clip_ratio/region_mean": low | high}
    elif objective.loss_type == "cispo":
        flags = {"cispo_clip_ratio": (coef > objective.epsilon_high) & (adv > 0)}
    token_values = {}
    if kl is not None:
        token_values["kl"] = kl.detach()
    if entropy is not None:
        token_values["entropy"] = entropy
    if not sequence_level:
        token_values.update({k: v.float() for k, v in flags.items()})
    names = list(token_values)
    sums = per_document(*[token_values[k] for k in names]) if names else None
    n = tokens[:completions]
    total = float(n.sum())
    out: dict[str, tuple[float, float]] = {}
    for i, name in enumerate(names):
        out[name] = (float(sums[i][:completions].sum()), total)
    extremes: dict[str, float] = {}
    if flags:
        for name, flag in flags.items():
            if sequence_level:  # one value per completion, a mean over all of them
                out[name] = (float(flag[:completions].float().sum()), float(completions))
        if "clip_ratio/low_mean" in flags:
            if sequence_level:
                low_seq = flags["clip_ratio/low_mean"][:completions].float()
                high_seq = flags["clip_ratio/high_mean"][:completions].float()
            else:
                low_seq = sums[names.index("clip_ratio/low_mean")][:completions] / n
                high_seq = sums[names.index("clip_ratio/high_mean")][:completions] / n
            extremes["clip_ratio/low_min"] = float(_nan_extreme(low_seq, min))
            extremes["clip_ratio/high_max"] = float(_nan_extreme(high_seq, max))
    return out, extremes


def _nan_extreme(values: torch.Tensor, pick) -> float:
    """min/max ignoring NaN (a completion with no scored token); NaN when all are."""
    finite = [v for v in values.tolist() if v == v]
    return pick(finite) if finite else float("nan")

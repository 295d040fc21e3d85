"""GRPO's reward functions and advantages, as TRL's `GRPOTrainer` computes them.

Reward functions are the user's Python (`trl.reward_funcs`), called with TRL's signature:
`f(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
log_metric=)`, one value per completion (None: the function does not apply, as in TRL). They
run once per completion, on the first rank of its SP group; what a function did wrong (it
raises, returns the wrong number of values, a NaN or not a number) is one paragraph that
names the function and the sample, on every rank. A reward model (an entry naming a
sequence-classification model, `train/reward_model.py`) is scored by every rank of the SP
group together, each holding its share of each text.

Advantages follow TRL: the weighted sum of the rewards (or, `normalize_then_sum`, of each
function's group-normalised rewards) minus its group mean, divided by the std (+1e-4) of the
group, of the batch, or by nothing (`scale_rewards`); a completion no function scored has 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from longctx_cli.config import Config
from longctx_cli.config.reward_models import reward_model_source
from longctx_cli.config.sections.grpo import is_reward_model
from longctx_cli.errors import UserError
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.train.reward_model import RewardModel
from longctx_cli.user_code import resolve_callable


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (NaN where fewer than 2 values), as TRL's."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    out = var.sqrt()
    return out if keep else out.reshape(())


@dataclass
class RewardFunctions:
    """The run's reward functions, their TRL names and weights."""

    functions: list[Callable | RewardModel]  # in `trl.reward_funcs` order
    names: list[str]
    weights: torch.Tensor
    logged: dict[str, list[float]] = field(default_factory=dict)  # log_metric values
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra columns

    @classmethod
    def from_config(cls, config: Config, state: ParallelState | None = None,
                    ) -> RewardFunctions:
        """The functions imported and the reward models loaded (on every rank: a model is
        scored by its whole SP group), with TRL's names."""
        trl = config.trl
        tokenizers = trl.reward_processing_classes or [None] * len(trl.reward_funcs)
        functions: list[Callable | RewardModel] = []
        for i, (name, tokenizer) in enumerate(zip(trl.reward_funcs, tokenizers, strict=True)):
            if is_reward_model(name):
                functions.append(RewardModel.load(reward_model_source(name, config), config,
                                                  state or ParallelState(),
                                                  reward_model_source(tokenizer, config)))
            else:
                functions.append(resolve_callable(name, config.source_dir,
                                                  f"trl.reward_funcs[{i}]"))
        weights = trl.reward_weights or [1.0] * len(functions)
        names = [f.name if isinstance(f, RewardModel) else getattr(f, "__name__", n)
                 for f, n in zip(functions, trl.reward_funcs, strict=True)]
        return cls(functions, names, torch.tensor(weights, dtype=torch.float32))

    def score_models(self, prompts: list[Any], completions: list[Any],
                     state: ParallelState) -> dict[int, list[float]]:
        """The reward models' scores by their place in `functions`; every rank of the SP
        group calls this with the same arguments (each model's forward is SP)."""
        return {j: f.score(prompts, completions, state) for j, f in enumerate(self.functions)
                if isinstance(f, RewardModel)}

    def score(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
              columns: list[dict[str, Any]], step: int, where: list[str],
              model_scores: dict[int, list[float]] | None = None) -> list[list[float]]:
        """`[completions][functions]` rewards (NaN: not applicable); `where` names each
        completion's sample for the error messages; `model_scores`: the reward models'
        (`score_models`), by place."""
        keys = sorted({k for c in columns for k in c})
        kwargs = {k: [c.get(k) for c in columns] for k in keys}
        state = SimpleNamespace(global_step=step)
        out = [[math.nan] * len(self.functions) for _ in completions]
        for j, (function, name) in enumerate(zip(self.functions, self.names, strict=True)):
            if isinstance(function, RewardModel):
                for i, value in enumerate((model_scores or {})[j]):
                    out[i][j] = value
                continue
            try:
                values = function(prompts=prompts, completions=completions,
                                  completion_ids=completion_ids, trainer_state=state,
                                  log_extra=self._log_extra, log_metric=self._log_metric,
                                  **kwargs)
            except Exception as e:  # the user's code may fail in any way
                raise UserError(
                    f"reward function `{name}` raised {type(e).__name__}: {e} while scoring "
                    f"{len(completions)} completions (of {where[0]}, ...).",
                    where="trl.reward_funcs",
                    fix="fix the function; it receives prompts=, completions=, "
                    "completion_ids= and every other dataset column as lists.") from None
            values = list(values) if values is not None else []
            if len(values) != len(completions):
                raise UserError(
                    f"reward function `{name}` returned {len(values)} values for "
                    f"{len(completions)} completions (of {where[0]}, ...).",
                    where="trl.reward_funcs",
                    fix="return one reward per completion (None where it does not apply).")
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                        isinstance(value, float) and math.isnan(value)):
                    raise UserError(
                        f"reward function `{name}` returned {value!r} for completion {i} of "
                        f"{where[i]}; a reward must be a number (None: not applicable).",
                        where="trl.reward_funcs", fix="return a finite number or None.")
                out[i][j] = float(value)
        return out

    def _log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(name, []).append(float(value))

    def _log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)


def advantages(rewards: torch.Tensor, weights: torch.Tensor, generations: int,
               scale: str, aggregation: str = "sum_then_normalize",
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's advantages of a generation batch `rewards` `[completions, functions]` (groups of
    `generations` consecutive completions), and its reward metrics but per-function ones."""
    unscorable = torch.isnan(rewards).all(dim=1)
    if aggregation == "sum_then_normalize":
        total = (rewards * weights[None]).nansum(dim=1)
        total[unscorable] = math.nan
        grouped = total.view(-1, generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
        if scale in ("group", "none"):
            std = nanstd(grouped, dim=1).view(-1).repeat_interleave(generations)
        else:
            std = nanstd(total).expand_as(total)
        out = total - mean
        if scale != "none":
            out = out / (std + 1e-4)
    else:  # normalize_then_sum
        grouped = rewards.view(-1, generations, rewards.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1)
        normalised = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards.shape[1])
        total = (normalised * weights[None]).nansum(dim=1)
        total[unscorable] = math.nan
        std = nanstd(total).expand_as(total)
        out = (total - torch.nanmean(total)) / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    shown = (rewards * weights[None]).nansum(dim=1)
    shown[unscorable] = math.nan
    metrics = {"reward": float(torch.nanmean(shown)), "reward_std": float(nanstd(shown)),
               "frac_reward_zero_std": float(zero_std.float().mean())}
    return torch.nan_to_num(out, nan=0.0), metrics


def function_metrics(rewards: torch.Tensor, names: list[str]) -> dict[str, float]:
    """TRL's `rewards/<name>/mean` and `/std` over the generation batch."""
    out = {}
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, j]))
        out[f"rewards/{name}/std"] = float(nanstd(rewards[:, j]))
    return out

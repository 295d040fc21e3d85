"""The optimizer and the learning-rate schedule, with Axolotl's meanings.

Optimizer names are Axolotl's (= transformers' `optim` names): torch AdamW/SGD,
bitsandbytes' 8-bit and paged ones, torchao's 8/4-bit and fp8 states. The libraries are
optional extras, imported only when named.
"""

from __future__ import annotations

import math

import torch

from longctx_cli.config import Config
from longctx_cli.errors import UserError

# name -> (module, class) of the optimizer; "adamw"-style names share one constructor.
_BNB = {
    "adamw_bnb_8bit": "AdamW8bit",
    "adamw_8bit": "AdamW8bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
    "paged_adamw": "PagedAdamW",
    "lion_8bit": "Lion8bit",
    "lion_32bit": "Lion32bit",
    "paged_lion_8bit": "PagedLion8bit",
    "paged_lion_32bit": "PagedLion32bit",
}
_TORCHAO = {
    "adamw_torch_8bit": "AdamW8bit",
    "ao_adamw_8bit": "AdamW8bit",
    "adamw_torch_4bit": "AdamW4bit",
    "ao_adamw_4bit": "AdamW4bit",
    "ao_adamw_fp8": "AdamWFp8",
}


def _import(module: str, extra: str, name: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"`optimizer` = {name!r} needs the `{module}` package, which is not installed.",
            where="optimizer",
            fix=f"`pip install 'longctx[{extra}]'`, or use `optimizer: adamw_torch`.",
        ) from None


def optimizer_class(name: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class of an Axolotl name and the extra arguments it takes."""
    if name in ("adamw", "adamw_torch"):
        return torch.optim.AdamW, {}
    if name == "adamw_torch_fused":
        return torch.optim.AdamW, {"fused": True}
    if name == "sgd":
        return torch.optim.SGD, {}
    if name in _BNB:
        return getattr(_import("bitsandbytes.optim", "bnb", name), _BNB[name]), {}
    if name in _TORCHAO:
        return getattr(_import("torchao.optim", "torchao", name), _TORCHAO[name]), {}
    raise UserError(f"`optimizer` = {name!r} is not supported.", where="optimizer",
                    fix="see docs/config.md for the optimizer names.")


def make_optimizer(config: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls, extra = optimizer_class(config.optimizer)
    if cls is torch.optim.SGD:
        return cls(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    kwargs = {"lr": config.learning_rate, "betas": (config.adam_beta1, config.adam_beta2),
              "weight_decay": config.weight_decay, **extra}
    if "lion" not in config.optimizer:  # Lion has no epsilon
        kwargs["eps"] = config.adam_epsilon
    return cls(params, **kwargs)


def warmup_steps(config: Config, num_steps: int) -> int:
    if config.warmup_ratio is not None:
        return math.ceil(config.warmup_ratio * num_steps)
    return config.warmup_steps or 0


def make_scheduler(config: Config, optimizer: torch.optim.Optimizer, num_steps: int):
    """transformers' schedule of that name; Axolotl's cosine_min_lr_ratio selects
    cosine_with_min_lr, as Axolotl does."""
    from transformers import get_scheduler

    name = config.lr_scheduler
    kwargs = dict(config.lr_scheduler_kwargs or {})
    if config.cosine_min_lr_ratio is not None and name == "cosine":
        name = "cosine_with_min_lr"
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        if "min_lr" not in kwargs:
            kwargs.setdefault("min_lr_rate", config.cosine_min_lr_ratio or 0.0)
    if name == "warmup_stable_decay":
        kwargs.setdefault("num_decay_steps", max(1, num_steps // 10))
    warmup = warmup_steps(config, num_steps)
    try:
        return get_scheduler(
            name, optimizer, num_warmup_steps=warmup, num_training_steps=num_steps,
            scheduler_specific_kwargs=kwargs,
        )
    except (TypeError, ValueError) as e:
        raise UserError(
            f"the `{name}` schedule rejected its arguments: {e}",
            where="lr_scheduler_kwargs",
            fix="pass only that schedule's arguments (see transformers.get_scheduler).",
        ) from None


def is_plateau(config: Config) -> bool:
    """reduce_lr_on_plateau steps on eval loss, not on every optimizer step."""
    return config.lr_scheduler == "reduce_lr_on_plateau"

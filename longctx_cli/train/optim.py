"""The optimizer and the learning-rate schedule, with Axolotl's meanings.

Optimizer names are Axolotl's (= transformers' `optim` names): torch AdamW/SGD,
bitsandbytes' 8-bit and paged ones, torchao's 8/4-bit and fp8 states. The libraries are
optional extras, imported only when named. Schedule names and arguments are transformers'
(`get_scheduler`); the schedules are built here on torch's LambdaLR with the same formulas,
so that no rank imports `transformers.optimization` for them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

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


# Optimizer names that need torchao (a rank of any other run never imports it).
TORCHAO_OPTIMIZERS = frozenset(_TORCHAO)

# What `make_scheduler` returns: a LambdaLR, or ReduceLROnPlateau (stepped on the eval loss).
Schedule = LRScheduler | ReduceLROnPlateau


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
    training = config.training
    cls, extra = optimizer_class(training.optimizer)
    if cls is torch.optim.SGD:
        return cls(params, lr=training.learning_rate, weight_decay=training.weight_decay)
    kwargs = {"lr": training.learning_rate, "betas": (training.adam_beta1, training.adam_beta2),
              "weight_decay": training.weight_decay, **extra}
    if "lion" not in training.optimizer:  # Lion has no epsilon
        kwargs["eps"] = training.adam_epsilon
    return cls(params, **kwargs)


def warmup_steps(config: Config, num_steps: int) -> int:
    if config.training.warmup_ratio is not None:
        return math.ceil(config.training.warmup_ratio * num_steps)
    return config.training.warmup_steps or 0


def make_scheduler(config: Config, optimizer: torch.optim.Optimizer, num_steps: int
                   ) -> Schedule:
    """The schedule of that name, as `transformers.get_scheduler` builds it (same formulas,
    same arguments, same state in a checkpoint); Axolotl's cosine_min_lr_ratio selects
    cosine_with_min_lr, as Axolotl does. Built here rather than imported: importing
    `transformers.optimization` imports its trainer utilities and with them peft and
    bitsandbytes, over a second of every rank's start-up (tests/test_startup_schedules.py
    holds every schedule equal to transformers')."""
    training = config.training
    name = training.lr_scheduler
    kwargs = dict(training.lr_scheduler_kwargs or {})
    if training.cosine_min_lr_ratio is not None and name == "cosine":
        name = "cosine_with_min_lr"
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        if "min_lr" not in kwargs:
            kwargs.setdefault("min_lr_rate", training.cosine_min_lr_ratio or 0.0)
    if name == "warmup_stable_decay":
        kwargs.setdefault("num_decay_steps", max(1, num_steps // 10))
    warmup = warmup_steps(config, num_steps)
    try:
        return build_schedule(name, optimizer, warmup, num_steps, kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(
            f"the `{name}` schedule rejected its arguments: {e}",
            where="lr_scheduler_kwargs",
            fix="pass only that schedule's arguments (see transformers.get_scheduler).",
        ) from None


def build_schedule(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                   num_training_steps: int, kwargs: dict[str, Any]
                   ) -> Schedule:
    """`transformers.get_scheduler(name, optimizer, num_warmup_steps, num_training_steps,
    scheduler_specific_kwargs=kwargs)` without importing transformers. As there, `constant`
    and `constant_with_warmup` ignore `kwargs`, and an argument a schedule does not take is a
    TypeError."""
    if name == "reduce_lr_on_plateau":
        return ReduceLROnPlateau(optimizer, **kwargs)
    if name == "constant":
        return LambdaLR(optimizer, _constant_factor)
    if name == "constant_with_warmup":
        return LambdaLR(optimizer, partial(_constant_with_warmup_factor,
                                           num_warmup_steps=num_warmup_steps))
    builders = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_restarts,
                "polynomial": _polynomial, "inverse_sqrt": _inverse_sqrt,
                "cosine_with_min_lr": _cosine_min_lr,
                "cosine_warmup_with_min_lr": _cosine_warmup_min_lr,
                "warmup_stable_decay": _warmup_stable_decay}
    if name not in builders:
        raise ValueError(f"unknown schedule {name!r}")
    if name == "inverse_sqrt":  # it has no end: transformers passes it no step count
        return _inverse_sqrt(optimizer, num_warmup_steps, **kwargs)
    return builders[name](optimizer, num_warmup_steps, num_training_steps, **kwargs)


# Each schedule is a LambdaLR over a `partial` of a module-level factor, as transformers
# builds it: a checkpoint's scheduler state is the same whichever of the two built it.

def _warmup_ramp(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _constant_factor(_: int = 0) -> float:
    return 1


def _constant_with_warmup_factor(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear_factor(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup_ramp(step, num_warmup_steps)
    left = float(num_training_steps - step)
    return max(0.0, left / float(max(1, num_training_steps - num_warmup_steps)))


def _decay_progress(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    """The share of the decay phase done at `step` (0 when it starts)."""
    return float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))


def _cosine_factor(step: int, *, num_warmup_steps: int, num_training_steps: int,
                   num_cycles: float, min_lr_rate: float = 0.0) -> float:
    if step < num_warmup_steps:
        return _warmup_ramp(step, num_warmup_steps)
    progress = _decay_progress(step, num_warmup_steps, num_training_steps)
    wave = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    if min_lr_rate == 0.0:  # plain cosine: no rescaling, as transformers' `cosine` computes
        return max(0.0, wave)
    return max(0, wave * (1 - min_lr_rate) + min_lr_rate)


def _cosine_restarts_factor(step: int, *, num_warmup_steps: int, num_training_steps: int,
                            num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _warmup_ramp(step, num_warmup_steps)
    progress = _decay_progress(step, num_warmup_steps, num_training_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial_factor(step: int, *, num_warmup_steps: int, num_training_steps: int,
                       lr_end: float, power: float, lr_init: float) -> float:
    # LambdaLR multiplies by the initial learning rate: the factor is the rate over it.
    if step < num_warmup_steps:
        return _warmup_ramp(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt_factor(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup_ramp(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


def _cosine_warmup_min_lr_factor(step: int, *, num_warmup_steps: int, num_training_steps: int,
                                 num_cycles: float, min_lr_rate: float,
                                 warmup_lr_rate: float | None) -> float:
    # This one counts a step as done when it starts (the `+ 1`s), unlike the others.
    step, warmup, total = float(step), float(num_warmup_steps), float(num_training_steps)
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, warmup)
        rate = float(warmup_lr_rate)
        return rate + (1.0 - rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    wave = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, wave * (1 - min_lr_rate) + min_lr_rate)


def _shape(kind: str, progress: float, rising: bool) -> float:
    """The warm-up (`rising`) or decay curve of warmup_stable_decay at `progress` in [0, 1]."""
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "1-sqrt":
        return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)
    return (0.5 * (1.0 - math.cos(math.pi * progress)) if rising
            else 0.5 * (1.0 + math.cos(math.pi * progress)))


def _wsd_factor(step: int, *, num_warmup_steps: int, num_stable_steps: int,
                num_decay_steps: int, warmup_type: str, decay_type: str, min_lr_ratio: float,
                num_cycles: float) -> float:
    if step < num_warmup_steps:
        factor = _shape(warmup_type, _warmup_ramp(step, num_warmup_steps), rising=True)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = (float(step - num_warmup_steps - num_stable_steps)
                    / float(max(1, num_decay_steps)))
        if decay_type == "cosine":  # the decay's cosine may run several waves
            factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        else:
            factor = _shape(decay_type, progress, rising=False)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def _linear(optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int,
            last_epoch: int = -1) -> LambdaLR:
    return LambdaLR(optimizer, partial(_linear_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps), last_epoch)


def _cosine(optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int,
            num_cycles: float = 0.5, last_epoch: int = -1) -> LambdaLR:
    return LambdaLR(optimizer, partial(_cosine_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps,
                                       num_cycles=num_cycles), last_epoch)


def _cosine_restarts(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                     num_training_steps: int, num_cycles: int = 1,
                     last_epoch: int = -1) -> LambdaLR:
    return LambdaLR(optimizer, partial(_cosine_restarts_factor,
                                       num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps,
                                       num_cycles=num_cycles), last_epoch)


def _polynomial(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                num_training_steps: int, lr_end: float = 1e-7, power: float = 1.0,
                last_epoch: int = -1) -> LambdaLR:
    lr_init = optimizer.defaults["lr"]
    if not lr_init > lr_end:
        raise ValueError(f"lr_end ({lr_end}) must be smaller than initial lr ({lr_init})")
    return LambdaLR(optimizer, partial(_polynomial_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps, lr_end=lr_end,
                                       power=power, lr_init=lr_init), last_epoch)


def _inverse_sqrt(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                  timescale: int | None = None, last_epoch: int = -1) -> LambdaLR:
    if timescale is None:
        timescale = num_warmup_steps or 10_000
    return LambdaLR(optimizer, partial(_inverse_sqrt_factor, num_warmup_steps=num_warmup_steps,
                                       timescale=timescale), last_epoch=last_epoch)


def _min_lr_rate(optimizer: torch.optim.Optimizer, min_lr: float | None,
                 min_lr_rate: float | None) -> float:
    """The floor as a share of the initial learning rate, from exactly one of the two."""
    if min_lr is not None and min_lr_rate is not None:
        raise ValueError("Only one of min_lr or min_lr_rate should be set")
    if min_lr is not None:
        return min_lr / optimizer.defaults["lr"]
    if min_lr_rate is None:
        raise ValueError("One of min_lr or min_lr_rate should be set through the "
                         "`lr_scheduler_kwargs`")
    return min_lr_rate


def _cosine_min_lr(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                   num_training_steps: int, num_cycles: float = 0.5, last_epoch: int = -1,
                   min_lr: float | None = None, min_lr_rate: float | None = None) -> LambdaLR:
    rate = _min_lr_rate(optimizer, min_lr, min_lr_rate)
    return LambdaLR(optimizer, partial(_cosine_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps,
                                       num_cycles=num_cycles, min_lr_rate=rate), last_epoch)


def _cosine_warmup_min_lr(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                          num_training_steps: int, num_cycles: float = 0.5,
                          last_epoch: int = -1, min_lr: float | None = None,
                          min_lr_rate: float | None = None,
                          warmup_lr_rate: float | None = None) -> LambdaLR:
    rate = _min_lr_rate(optimizer, min_lr, min_lr_rate)
    return LambdaLR(optimizer, partial(_cosine_warmup_min_lr_factor,
                                       num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps,
                                       num_cycles=num_cycles, min_lr_rate=rate,
                                       warmup_lr_rate=warmup_lr_rate), last_epoch)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup_stable_decay(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                         num_training_steps: int | None, num_decay_steps: int,
                         num_stable_steps: int | None = None, warmup_type: str = "linear",
                         decay_type: str = "cosine", min_lr_ratio: float = 0,
                         num_cycles: float = 0.5, last_epoch: int = -1) -> LambdaLR:
    if warmup_type not in _WSD_SHAPES:
        raise ValueError(f"Unknown warmup type: {warmup_type}, expected 'linear', 'cosine' "
                         "or '1-sqrt'")
    if decay_type not in _WSD_SHAPES:
        raise ValueError(f"Unknown decay type: {decay_type}, expected 'linear', 'cosine' "
                         "or '1-sqrt'")
    if num_stable_steps is None:
        if num_training_steps is None:
            raise ValueError("Either num_training_steps or num_stable_steps must be specified.")
        num_stable_steps = num_training_steps - num_warmup_steps - num_decay_steps
    return LambdaLR(optimizer, partial(_wsd_factor, num_warmup_steps=num_warmup_steps,
                                       num_stable_steps=num_stable_steps,
                                       num_decay_steps=num_decay_steps,
                                       warmup_type=warmup_type, decay_type=decay_type,
                                       min_lr_ratio=min_lr_ratio, num_cycles=num_cycles),
                    last_epoch)


def is_plateau(config: Config) -> bool:
    """reduce_lr_on_plateau steps on eval loss, not on every optimizer step."""
    return config.training.lr_scheduler == "reduce_lr_on_plateau"

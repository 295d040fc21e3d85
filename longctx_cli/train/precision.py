"""Mixed precision of a training step: what `dtype` means for weights, compute and the loss.

* ``float32``: everything in float32.
* ``bfloat16``: weights load in bf16 and compute in bf16 (what transformers does with
  ``dtype=bfloat16``); LoRA adapters stay float32 (peft), so their optimizer state is
  float32. Full fine-tuning updates bf16 weights directly, as a bf16-loaded HF model does;
  bf16 has float32's range, so no loss scaling is needed.
* ``float16``: fp16 overflows and its gradients underflow, and ``GradScaler`` refuses fp16
  gradients, so trainable weights are kept in float32 (master weights; LoRA adapters
  already are), the forward runs under ``torch.autocast(float16)``, and the loss is scaled
  with ``torch.amp.GradScaler``: a step whose unscaled gradients overflow is skipped and the
  scale lowered, which is loss scaling at work, not a failure. With FSDP2 or TP each rank
  holds part of the gradients, so the overflow check is agreed over the world
  (``ShardedGradScaler``): every rank skips and backs off together.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Precision:
    """The step's autocast dtype (None: off) and loss scaler (None: no scaling)."""

    device_type: str = "cpu"
    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: gradients back to their true size."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def overflowed(self, grad_norm: float) -> bool:
        """A non-finite gradient under loss scaling: the scaler skips the step and backs off."""
        return self.scaler is not None and not math.isfinite(grad_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def update(self) -> None:
        """After every step (taken or skipped): the scaler adapts its scale."""
        if self.scaler is not None:
            self.scaler.update()


def setup_precision(model: nn.Module, dtype: str, device: torch.device,
                    sharded_grads: bool = False) -> Precision:
    """The step's precision for ``dtype`` on ``device`` (see the module doc).

    ``sharded_grads``: each rank holds only part of the gradients (FSDP2, TP). An overflow
    then shows on some ranks only, so the scaler agrees on it over the world (all ranks skip
    the step and lower the scale together, or none does).
    """
    if dtype != "float16":
        return Precision(device.type)
    if any(p.requires_grad and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("float16 training needs float32 master weights (`build_model` "
                         "keeps them before any sharding)")
    if sharded_grads:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return Precision(device.type, torch.float16, ShardedGradScaler(device.type))
    return Precision(device.type, torch.float16, torch.amp.GradScaler(device.type))

"""The model's own Hugging Face training, the reference every parity test compares with.

Each optimizer step: every document through `forward(input_ids, labels=)` on its own (the
model shifts the labels itself), each document's mean loss weighted by its share of the
step's target tokens, gradients summed over the documents, clipped, one optimizer step:
the single-process computation of the same loss longctx computes over packed, sharded rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def own_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 steps: list[list[tuple[torch.Tensor, torch.Tensor | None]]],
                 max_grad_norm: float | None) -> dict[str, Any]:
    """Train `model` on `steps` (per step, its documents as `(input_ids, labels)`; labels
    None: every next token is a target). Returns the per-step losses and final weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for docs in steps:
        docs = [(ids, ids if labels is None else labels) for ids, labels in docs]
        targets = [int((labels[1:] != -100).sum()) for _, labels in docs]
        count = sum(targets)
        total = 0.0
        for (ids, labels), n in zip(docs, targets, strict=True):
            if n == 0:
                continue
            loss = model(input_ids=ids[None], labels=labels[None]).loss * (n / count)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, math.inf if max_grad_norm is None else max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    weights = {k: v.detach().double().numpy().copy() for k, v in model.named_parameters()}
    return {"losses": losses, "weights": weights}

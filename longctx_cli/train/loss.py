"""Summed cross-entropy over this rank's valid tokens.

The trainer divides by the exact global valid-token count itself, so these functions return
a *sum*, never a mean: a mean per rank or per micro-batch would weight short shards wrongly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longctx_cli.constants import IGNORE_INDEX


def _ce_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # `head` is the model's head (runtime/head.py: lm_head + the family's logit transform).
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def lm_loss_sum(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sum of next-token CE over tokens whose label is not -100.

    `hidden` is `[tokens, hidden_size]` (or with a leading batch dim of 1) and `shift_labels`
    is already shifted (label of position t is the token at t+1). With `chunk_size`, lm_head
    and CE run chunk by chunk under activation checkpointing, so only one chunk's
    `[chunk, vocab]` logits exist at a time, in forward and in backward.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1)
    if chunk_size is None or hidden.shape[0] <= chunk_size:
        return _ce_sum(lm_head, hidden, shift_labels)
    # Start from a zero that is connected to `hidden`: every rank must run the backward
    # through attention (it holds collectives), even when its shard has no valid token.
    total = hidden.sum().float() * 0.0
    for start in range(0, hidden.shape[0], chunk_size):
        labels_chunk = shift_labels[start : start + chunk_size]
        if bool((labels_chunk == IGNORE_INDEX).all()):
            # Exact to skip: a fully masked chunk has zero loss and zero gradient.
            continue
        total = total + checkpoint(
            _ce_sum,
            lm_head,
            hidden[start : start + chunk_size],
            labels_chunk,
            use_reentrant=False,
        )
    return total


def valid_token_count(shift_labels: torch.Tensor) -> int:
    """Number of positions that contribute to the loss."""
    return int((shift_labels != IGNORE_INDEX).sum())

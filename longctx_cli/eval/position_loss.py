"""Mean next-token loss per position bucket of the held-out rows.

The position of a token is its position inside its document (`position_ids`, which restart
at every packed document): the loss at position `p` is the cross-entropy of predicting token
`p + 1` from the `p + 1` tokens before it, i.e. with that much context. For rows holding one
document this is the position within the row. Positions `[0, sequence_len)` are cut into
`eval_position_buckets` equal buckets. Every valid target token counts once, whichever rank
holds it: each rank sums its tokens' losses and counts per bucket, and one all-reduce adds
them up, so the means are exact under SP and data parallelism.

A vision-language run's rows carry their images: each row goes through the forward training
uses (`runtime.batches.row_batch`: the tower split by images, features merged, then the row
sharded), and a token's position counts the image tokens before it in its document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import IGNORE_INDEX
from longctx_cli.runtime.batches import row_batch
from longctx_cli.runtime.model import sp_hidden_states


@dataclass
class PositionLoss:
    starts: list[int]  # first position of each bucket
    ends: list[int]  # one past the last position of each bucket
    loss_sum: list[float]
    tokens: list[int]

    @property
    def mean(self) -> list[float]:
        """Mean loss per bucket (NaN for a bucket with no tokens)."""
        return [s / n if n else math.nan for s, n in zip(self.loss_sum, self.tokens, strict=True)]

    @property
    def overall(self) -> float:
        """Token-weighted mean over all buckets (the trainer's eval loss)."""
        total = sum(self.tokens)
        return sum(self.loss_sum) / total if total else math.nan

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"bucket": i, "start": a, "end": b, "tokens": n, "loss": None if math.isnan(m) else m}
            for i, (a, b, n, m) in enumerate(
                zip(self.starts, self.ends, self.tokens, self.mean, strict=True))
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"overall_loss": None if math.isnan(self.overall) else self.overall,
                "tokens": sum(self.tokens), "buckets": self.rows()}


def bucket_edges(sequence_len: int, buckets: int) -> tuple[list[int], list[int]]:
    """[start, end) of each bucket; bucket i holds positions p with i*S <= p*B < (i+1)*S."""
    buckets = min(buckets, sequence_len)
    starts = [-(-i * sequence_len // buckets) for i in range(buckets)]
    return starts, [*starts[1:], sequence_len]


def bucket_of(positions: torch.Tensor, sequence_len: int, buckets: int) -> torch.Tensor:
    """Bucket index of each position (positions beyond `sequence_len` go to the last one)."""
    buckets = min(buckets, sequence_len)
    return (positions.long() * buckets // sequence_len).clamp(max=buckets - 1)


def token_losses(
    lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """CE of each row of `hidden` against `labels`, `chunk` tokens of logits at a time."""
    parts = [
        F.cross_entropy(lm_head(hidden[i : i + chunk]).float(), labels[i : i + chunk],
                        reduction="none")
        for i in range(0, hidden.shape[0], chunk)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0)


@torch.no_grad()
def position_loss(
    decoder: nn.Module,
    lm_head: nn.Module,
    rows: Any,
    sequence_len: int,
    buckets: int,
    state: ParallelState,
    pad_id: int,
    chunk: int = 4096,
    show_progress: bool = False,
    label: str = "",
) -> PositionLoss:
    """Per-bucket loss of `rows` (a prepared dataset); every rank returns the global result."""
    dp_rank, dp_size, device = state.dp_rank, state.layout.dp, state.device
    starts, ends = bucket_edges(sequence_len, buckets)
    sums = torch.zeros(len(starts), dtype=torch.float64, device=device)
    counts = torch.zeros(len(starts), dtype=torch.float64, device=device)
    mine = range(dp_rank, len(rows), dp_size)
    for index in tqdm(mine, desc=f"position loss {label}".strip(), unit="row",
                      disable=None if show_progress else True, dynamic_ncols=True):
        # The row with its images, if it has any (a text row is sharded as before).
        batch = row_batch(rows, index, state, pad_id, whole_rows=True)  # causal-LM rows
        hidden = sp_hidden_states(decoder, batch, where="--checkpoint")
        labels = batch.shift_labels.reshape(-1)
        valid = labels != IGNORE_INDEX
        if not bool(valid.any()):
            continue
        losses = token_losses(lm_head, hidden[valid], labels[valid], chunk)
        bucket = bucket_of(batch.position_ids.reshape(-1)[valid], sequence_len, len(starts))
        sums.index_add_(0, bucket, losses.double())
        counts.index_add_(0, bucket, torch.ones_like(losses, dtype=torch.float64))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Sums over the world: SP ranks hold disjoint tokens, DP ranks disjoint rows.
        both = torch.stack([sums, counts])
        dist.all_reduce(both)
        sums, counts = both[0], both[1]
    return PositionLoss(starts, ends, sums.tolist(), [int(c) for c in counts.tolist()])

"""Rollout rows: prompt groups laid out for the sharded forward, and per-token values on them.

A group is one prompt and its completions. With the prompt shared (the default), the row
holds the prompt once with the first completion after it; every further completion is a
branch document made of the prompt's last token and the completion, its positions going on
from the prompt's, which attends the prompt's keys and itself (`SPMeta.prefixes`). The
prompt's last token is repeated so that each branch predicts its own first token. Unshared,
each completion is a document of its own after a full copy of the prompt. Either way the
documents of a row are its completions in order, and a completion's targets are its tokens
(none when it is masked: `mask_truncated_completions`).
"""

from __future__ import annotations

import torch

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import slice_sequence


def group_row(groups: list[tuple[list[int], list[list[int]], list[bool]]], share_prompt: bool,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(input_ids, position_ids, labels, scored tokens of each completion) of one row of
    `groups`: (prompt ids, completions, which completions are scored)."""
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    scored: list[int] = []
    for prompt, completions, keep in groups:
        for i, (completion, kept) in enumerate(zip(completions, keep, strict=True)):
            head = prompt[-1:] if share_prompt and i > 0 and len(prompt) > 1 else prompt
            first = len(prompt) - len(head)
            ids += head + completion
            positions += list(range(first, first + len(head) + len(completion)))
            labels += [IGNORE_INDEX] * len(head) + (completion if kept else
                                                    [IGNORE_INDEX] * len(completion))
            scored.append(len(completion) if kept else 0)
    ids_t, positions_t, labels_t = (torch.tensor(x, dtype=torch.long)
                                    for x in (ids, positions, labels))
    return ids_t, positions_t, labels_t, scored


def token_values(per_completion: list[list[float]], row_labels: torch.Tensor,
                 padded_len: int) -> torch.Tensor:
    """A full-row float tensor `[padded_len]` holding, at the position that predicts each
    scored completion token (its shifted label), that token's value from `per_completion`
    (one list per completion, in row order, as long as the completion); 0 elsewhere."""
    out = torch.zeros(padded_len)
    targets = torch.cat([row_labels[1:], row_labels.new_full((1,), IGNORE_INDEX)])
    where = (targets != IGNORE_INDEX).nonzero().flatten()
    values = [v for completion in per_completion for v in completion]
    if len(values) != where.numel():
        raise ValueError(f"{len(values)} token values for {where.numel()} scored tokens")
    out[where] = torch.tensor(values, dtype=torch.float32)
    return out


def local_tokens(full: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's part of a full-row tensor in the order it scores its tokens: its SP
    shard, and under TP its own contiguous part of that."""
    local = slice_sequence(full, state)
    if state.layout.tp > 1:
        n = local.numel() // state.layout.tp
        local = local[state.tp_rank * n : (state.tp_rank + 1) * n]
    return local

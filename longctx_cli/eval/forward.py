"""The one forward pass every evaluation shares: a sharded row through the decoder."""

from __future__ import annotations

import torch
from torch import nn

from longctx_cli.errors import UserError
from longctx_cli.parallel.sharding import ShardedBatch


def local_hidden(decoder: nn.Module, batch: ShardedBatch) -> torch.Tensor:
    """Hidden states `[local_tokens, hidden]` of this rank's slice of the row."""
    hidden = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta
    ).last_hidden_state
    if batch.sp_meta.attention_calls == 0:
        # Without our attention each rank would only see its own slice: wrong, silently.
        raise UserError(
            "the model's attention layers did not call the sequence-parallel attention.",
            where="--checkpoint",
            fix="evaluate a model whose attention dispatches through transformers' "
            "AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...).",
        )
    return hidden.reshape(-1, hidden.shape[-1])


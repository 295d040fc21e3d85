"""Sequence parallelism: process groups, row sharding and exact SP attention."""

from .attention import ATTN_IMPLEMENTATION, register_sp_attention, sp_attention
from .mesh import ParallelState, build_parallel_state
from .sharding import (
    ShardedBatch,
    SPMeta,
    gather_sequence,
    make_sp_meta,
    shard_batch,
    slice_sequence,
)
from .torch_kernel import (
    AttentionFeatures,
    Segment,
    doc_causal_attention,
    doc_causal_backward,
    doc_causal_forward,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionFeatures",
    "ParallelState",
    "SPMeta",
    "Segment",
    "ShardedBatch",
    "build_parallel_state",
    "doc_causal_attention",
    "doc_causal_backward",
    "doc_causal_forward",
    "gather_sequence",
    "make_sp_meta",
    "register_sp_attention",
    "shard_batch",
    "slice_sequence",
    "sp_attention",
]

"""Sequence parallelism: process groups, row sharding and exact SP attention."""

from .attention import ATTN_IMPLEMENTATION, register_sp_attention, sp_attention
from .kernels import (
    AttentionFeatures,
    Segment,
    doc_causal_attention,
    doc_causal_backward,
    doc_causal_forward,
)
from .mesh import SPContext, build_parallel_groups, resolve_kernel, single_process_context
from .sharding import (
    ShardedBatch,
    SPMeta,
    gather_sequence,
    make_sp_meta,
    shard_batch,
    slice_sequence,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionFeatures",
    "SPContext",
    "SPMeta",
    "Segment",
    "ShardedBatch",
    "build_parallel_groups",
    "doc_causal_attention",
    "doc_causal_backward",
    "doc_causal_forward",
    "gather_sequence",
    "make_sp_meta",
    "register_sp_attention",
    "resolve_kernel",
    "shard_batch",
    "single_process_context",
    "slice_sequence",
    "sp_attention",
]

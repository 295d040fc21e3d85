"""One-token decode steps after a sequence-parallel prefill, with the KV cache left sharded.

After the prompt's SP forward (with a transformers ``DynamicCache``), every rank's cache holds
the keys and values of the prompt tokens it owns, in its local order, with all heads (the
layers update the cache before calling attention, so Ulysses and hybrid leave the same
sequence shard there). A decode step runs the same new token on every rank: each layer
appends that token's key/value to every rank's cache, then calls :func:`decode_attention`,
which attends the one query to this rank's cached keys only and merges the ranks' partial
results with their log-sum-exp (one all-reduce MAX and one SUM per layer):

    out = sum_r exp(lse_r - m) * out_r / sum_r exp(lse_r - m),  m = max_r lse_r

which is the softmax over the union of the ranks' keys. The tokens decoded after the prompt
sit in every rank's cache; only SP rank 0 counts them, so each key is counted once. Prompt
padding (the tail that makes the row divisible by the layout) is never counted.

The query sees every earlier token, so no positional mask applies: layers with a sliding
window or chunked attention (whose key set depends on positions) raise
:class:`DecodeUnsupported`, and the caller decodes by full SP forwards instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .features import AttentionFeatures
from .mesh import ParallelState


class DecodeUnsupported(RuntimeError):
    """A layer whose key set depends on positions (window, chunk): decode by full forwards."""


@dataclass
class DecodeMeta:
    """What every layer of one decode step needs; passed to the model as ``sp_meta=``."""

    ctx: ParallelState
    prompt_visible: torch.Tensor  # bool [local prompt tokens], False for the padding tail
    decoded: int  # tokens appended to every cache after the prompt, this step's included
    attention_calls: int = 0

    @classmethod
    def after_prefill(cls, ctx: ParallelState, local_ranges: tuple[tuple[int, int], ...],
                      prompt_len: int, device: torch.device) -> DecodeMeta:
        """Metadata for the first decode step after a prefill of `prompt_len` real tokens."""
        positions = torch.cat([torch.arange(a, b) for a, b in local_ranges])
        return cls(ctx, (positions < prompt_len).to(device), decoded=1)

    @property
    def counts_decoded(self) -> bool:
        return self.ctx.sp_rank == 0


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: DecodeMeta,
    features: AttentionFeatures,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one new query over the whole sharded cache.

    q ``[heads, dim]``; k/v ``[cached, kv_heads, dim]`` (this rank's cache, new token last);
    returns ``[heads, v_dim]``, the same on every rank of the SP group.
    """
    if features.window is not None or getattr(features, "chunk", None) is not None:
        raise DecodeUnsupported("a layer attends within a window or chunk")
    prompt = meta.prompt_visible.numel()
    if k.shape[0] != prompt + meta.decoded:
        raise DecodeUnsupported(
            f"the cache holds {k.shape[0]} entries, expected {prompt} prompt + {meta.decoded} "
            "decoded (a cache that drops entries)"
        )
    heads, kv_heads = q.shape[0], k.shape[1]
    group = heads // kv_heads
    qf, kf, vf = q.float(), k.float(), v.float()
    # [kv_heads, group, cached]: GQA without repeating k/v.
    scores = torch.einsum("hgd,lhd->hgl", qf.view(kv_heads, group, -1), kf) * features.scale
    if features.softcap is not None:
        scores = features.softcap * torch.tanh(scores / features.softcap)
    visible = torch.cat([meta.prompt_visible,
                         meta.prompt_visible.new_full((meta.decoded,), meta.counts_decoded)])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where this rank holds no visible key
    m = lse.clone()
    if meta.ctx.layout.sp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=meta.ctx.sp_group)
    if sinks is not None:  # one value-less logit per head, counted once
        m = torch.maximum(m, sinks.float().view(kv_heads, group))
    probs = torch.exp(scores - m[..., None])  # 0 at masked keys
    numerator = torch.einsum("hgl,lhd->hgd", probs, vf)
    denominator = probs.sum(-1)
    if meta.ctx.layout.sp > 1:
        both = torch.cat([numerator.flatten(), denominator.flatten()])
        dist.all_reduce(both, group=meta.ctx.sp_group)
        numerator = both[:numerator.numel()].view_as(numerator)
        denominator = both[numerator.numel():].view_as(denominator)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.float().view(kv_heads, group) - m)
    out = numerator / denominator[..., None]
    return out.reshape(heads, -1).to(q.dtype)

"""One-token decode steps after a sequence-parallel prefill, with the KV cache left sharded.

After the prompt's SP forward (with a transformers ``DynamicCache``), every rank's cache holds
the keys and values of the prompt tokens it owns, in its local order, with all heads (the
layers update the cache before calling attention, so Ulysses and hybrid leave the same
sequence shard there). Those prompt keys and values are then taken out of the cache and
kept in :class:`DecodeMeta` (``prompt_kv``), once, whatever the number of sequences decoded
after the prompt: ``n`` samples of one prompt share its shard instead of holding ``n`` copies.
A decode step runs the same new tokens (one per sequence, a batch of ``n``) on every rank:
each layer appends them to a fresh cache that holds decoded tokens only, then calls
:func:`decode_attention`, which attends each query to this rank's prompt keys and to its own
sequence's decoded keys, and merges the ranks' partial results with their log-sum-exp (one
all-reduce MAX and one SUM per layer):

    out = sum_r exp(lse_r - m) * out_r / sum_r exp(lse_r - m),  m = max_r lse_r

which is the softmax over the union of the ranks' keys. The decoded tokens sit in every
rank's cache; only SP rank 0 counts them, so each key is counted once. Prompt padding (the
tail that makes the row divisible by the layout) is never counted.

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
    # Per layer, this rank's prompt keys and values `[local prompt tokens, kv_heads, dim]`,
    # shared by every sequence of the batch; the cache then holds decoded tokens only.
    prompt_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    attention_calls: int = 0

    @classmethod
    def after_prefill(cls, ctx: ParallelState, local_ranges: tuple[tuple[int, int], ...],
                      prompt_len: int, device: torch.device,
                      prompt_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
                      ) -> DecodeMeta:
        """Metadata for the first decode step after a prefill of `prompt_len` real tokens."""
        positions = torch.cat([torch.arange(a, b) for a, b in local_ranges])
        return cls(ctx, (positions < prompt_len).to(device), decoded=1, prompt_kv=prompt_kv)

    @property
    def counts_decoded(self) -> bool:
        return self.ctx.sp_rank == 0


def held_out_prompt_kv(cache) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Every layer's prompt keys and values `[tokens, kv_heads, dim]` from a prefilled
    transformers cache of one sequence; raises `DecodeUnsupported` for a cache layer that is
    not plain keys and values (a window, a scan state)."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_sliding", False) or not isinstance(keys, torch.Tensor) or (
                not isinstance(values, torch.Tensor)) or keys.shape[0] != 1:
            raise DecodeUnsupported("a cache layer holds more than one sequence's keys and "
                                    "values (a window or a scan state)")
        out.append((keys[0].transpose(0, 1), values[0].transpose(0, 1)))
    return tuple(out)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: DecodeMeta,
    features: AttentionFeatures,
    sinks: torch.Tensor | None,
    layer: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new query over the whole sharded cache.

    q ``[batch, heads, dim]``; k/v ``[batch, cached, kv_heads, dim]`` (this rank's cache, new
    tokens last): the prompt and the decoded tokens, or, with ``meta.prompt_kv``, the decoded
    tokens only, the prompt's keys being ``meta.prompt_kv[layer]``. Returns
    ``[batch, heads, v_dim]``, the same on every rank of the SP group.
    """
    if features.window is not None or getattr(features, "chunk", None) is not None:
        raise DecodeUnsupported("a layer attends within a window or chunk")
    prompt = meta.prompt_visible.numel()
    held_out = meta.prompt_kv is not None
    expected = meta.decoded if held_out else prompt + meta.decoded
    if k.shape[1] < expected:
        raise DecodeUnsupported(
            f"the cache holds {k.shape[1]} entries, expected {expected} (a cache that drops "
            "entries)"
        )
    k, v = k[:, :expected], v[:, :expected]  # a preallocated cache has room for more
    batch, heads, kv_heads = q.shape[0], q.shape[1], k.shape[2]
    group = heads // kv_heads
    # Products in the cache's dtype (as the model's own attention takes them), the softmax
    # and the merge across ranks in float32; GQA without repeating k/v.
    qg = q.to(k.dtype).view(batch, kv_heads, group, -1)
    counted = meta.prompt_visible.new_full((meta.decoded,), meta.counts_decoded)
    visible = torch.cat([meta.prompt_visible, counted])
    if held_out:
        assert layer is not None, "held-out prompt keys are read by layer index"
        pk, pv = meta.prompt_kv[layer]
        prompt_scores = torch.einsum("bhgd,lhd->bhgl", qg, pk).float()
        own_scores = torch.einsum("bhgd,blhd->bhgl", qg, k).float()
        scores = torch.cat([prompt_scores, own_scores], dim=-1) * features.scale
    else:
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k).float() * features.scale
    if features.softcap is not None:
        scores = features.softcap * torch.tanh(scores / features.softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where this rank holds no visible key
    m = lse.clone()
    if meta.ctx.layout.sp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=meta.ctx.sp_group)
    if sinks is not None:  # one value-less logit per head, counted once
        m = torch.maximum(m, sinks.float().view(kv_heads, group))
    probs = torch.exp(scores - m[..., None])  # 0 at masked keys
    weights = probs.to(v.dtype)
    if held_out:
        numerator = (torch.einsum("bhgl,lhd->bhgd", weights[..., :prompt], pv).float()
                     + torch.einsum("bhgl,blhd->bhgd", weights[..., prompt:], v).float())
    else:
        numerator = torch.einsum("bhgl,blhd->bhgd", weights, v).float()
    denominator = probs.sum(-1)
    if meta.ctx.layout.sp > 1:
        both = torch.cat([numerator.flatten(), denominator.flatten()])
        dist.all_reduce(both, group=meta.ctx.sp_group)
        numerator = both[:numerator.numel()].view_as(numerator)
        denominator = both[numerator.numel():].view_as(denominator)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.float().view(kv_heads, group) - m)
    out = numerator / denominator[..., None]
    return out.reshape(batch, heads, -1).to(q.dtype)

"""Attention dropout in training, applied to the probabilities as the model's own attention does.

transformers' layers pass ``dropout=self.attention_dropout`` to the attention function in
training (0 in eval). Its eager and SDPA paths (SDPA runs its math backend on CPU) compute
``softmax(scores) * keep / (1 - p) @ v``, ``keep`` one Bernoulli(1 - p) draw per head, query
and key of a ``[batch, heads, queries, keys]`` tensor; flash-attn 2 draws the same law in its
kernel (``dropout_p``).

Dropout acts on whole rows of probabilities, so only a rank that holds every key of its
queries can apply it: sp 1, and Ulysses after its all-to-all (a rank holds every token of its
heads). A ring's rank sees a block of keys at a time; ``validate`` refuses rings and hybrid
at sp > 1 (``config.sections.model.check_attention_dropout``), and :func:`dropout_attention`
is the ranks' own guard.

What computes it:

* the ``flash`` kernel at sp 1: flash-attn 2's varlen function with ``dropout_p``, as the
  model's ``flash_attention_2`` calls it; the ``torch_flash`` kernel at sp 1: PyTorch's
  flash op with its ``dropout_p`` (as the model's SDPA runs it on CUDA), each call's philox
  seed and offset kept for its backward (rows without sinks or image runs; others below);
* everything else (the ``torch``, ``cudnn`` and ``fa4`` kernels, and every kernel under
  Ulysses at sp > 1, whose ranks would draw the same philox masks for their heads): the
  scores of one segment at a time (``[heads, queries, keys]`` in float32), softmax, and the
  keep mask drawn from the default generator for *all* the layer's heads at once, of which
  a rank keeps its own heads' (:func:`_segment`). Every rank
  of a Ulysses group draws the same mask, so no two heads share one, and a one-document row
  at sp 1 draws exactly the mask the model's SDPA math path draws. Backward is autograd's;
  gradient checkpointing restores the generator before its recompute, so it redraws the same
  mask. The scores are held per segment (as the model's eager and math paths hold the
  whole row's).
"""

from __future__ import annotations

import torch

from .block_geometry import full_row_segments
from .features import AttentionFeatures, Segment
from .kernel import TORCH_FLASH_OPS, fused_for
from .sharding import SPMeta
from .tiled import visible
from .torch_flash import varlen_backward, varlen_dropout_forward

WHOLE_ROWS = "sp 1, or sequence_parallel_mode ulysses"


def applies(meta: SPMeta) -> bool:
    """Whether this rank can apply attention dropout as the model does (whole rows)."""
    layout = meta.ctx.layout
    return layout.sp == 1 or layout.mode == "ulysses"


def dropout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    feats: AttentionFeatures,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's document-causal attention with the layer's dropout (``feats.dropout``).

    The strategy signature of :mod:`.attention`; q/k/v ``[local_tokens, heads, dim]``.
    """
    ctx = meta.ctx
    if not applies(meta):
        raise NotImplementedError(
            f"attention dropout (p={feats.dropout:g}) needs whole rows of attention "
            f"probabilities on a rank ({WHOLE_ROWS}); sequence_parallel_mode "
            f"{ctx.layout.mode} at sp {ctx.layout.sp} splits them across ranks")
    if ctx.layout.tp > 1:
        raise NotImplementedError(
            f"attention dropout (p={feats.dropout:g}) with tensor parallelism: every TP rank "
            "draws its heads' masks from the same random state, so heads would share masks")
    if meta.prefixes:
        raise NotImplementedError(
            "attention dropout with shared pair prompts (`prefix_sharing`): the model draws "
            "its prompt's dropout once per answer, a shared prompt once")
    if ctx.layout.sp == 1:
        plain = sinks is None and not meta.bidirectional  # what the fused kernels take
        if ctx.kernel.flash_attn and plain:
            from .ring_flash import equal_head_dims, flash_single

            q, k, v, v_dim = equal_head_dims(q, k, v)
            return flash_single(q, k, v, meta, feats)[..., :v_dim]
        if plain and fused_for(ctx.kernel, q, feats, v) is TORCH_FLASH_OPS:
            segments = full_row_segments(meta.cu_host)
            return FlashOpDropout.apply(q, k, v, segments, feats)
        return whole_row_attention(q, k, v, meta, feats, sinks, slice(0, q.shape[1]),
                                   q.shape[1])
    from longctx_cli.layout import head_split

    from .ulysses import build_exchange, heads_to_ranks, heads_to_seq

    ex = build_exchange(meta, ctx.sp_group, ctx.layout.sp)
    split = head_split(q.shape[1], k.shape[1], ex.size)  # even or not, by KV-head groups
    qh, kh, vh = heads_to_ranks(q, k, v, ex, feats.spent)  # head chunks: one chunk, all heads
    heads = split.q_slice(ex.member)
    local_sinks = None if sinks is None else sinks[heads]
    return heads_to_seq(whole_row_attention(qh, kh, vh, meta, feats, local_sinks, heads,
                                            q.shape[1]), ex, split.q_counts)


class FlashOpDropout(torch.autograd.Function):
    """The ``torch_flash`` kernel's op over a whole row with its own dropout: each call's
    philox seed and offset go to its backward, which redraws the same mask."""

    @staticmethod
    def forward(ctx, q, k, v, segments, feats):  # type: ignore[override]
        out, lse, states = varlen_dropout_forward(q, k, v, segments, feats, feats.dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.feats, ctx.states = segments, feats, states
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        feats = ctx.feats
        dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, ctx.segments,
                                     feats, dropout=feats.dropout, rng_states=ctx.states)
        return dq, dk, dv, None, None


def whole_row_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SPMeta,
    feats: AttentionFeatures,
    sinks: torch.Tensor | None,
    heads: slice,
    total_heads: int,
) -> torch.Tensor:
    """Attention with dropout over the whole row (``[T, heads here, dim]``): ``heads`` are
    this rank's of the layer's ``total_heads`` (the masks are drawn for all of them)."""
    segments = full_row_segments(meta.cu_host, meta.prefixes, meta.bidirectional)
    outs = [_segment(q, k, v, seg, feats, sinks, heads, total_heads) for seg in segments]
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
    if out.shape[0] != q.shape[0]:
        raise ValueError(f"the row's segments cover {out.shape[0]} of {q.shape[0]} tokens")
    return out


def _segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: Segment,
    feats: AttentionFeatures,
    sinks: torch.Tensor | None,
    heads: slice,
    total_heads: int,
) -> torch.Tensor:
    """One segment's output ``[rows, heads here, Dv]``: the model's softmax, dropout, sum."""
    groups = q.shape[1] // k.shape[1]
    qs = q[seg.q_start:seg.q_end].transpose(0, 1).float()  # [H, rows, D]
    ks, vs = (t[seg.k_start:seg.k_end].repeat_interleave(groups, 1).transpose(0, 1).float()
              for t in (k, v))
    rows, keys = qs.shape[1], ks.shape[1]
    s = torch.matmul(qs, ks.transpose(-1, -2)) * feats.scale
    if feats.softcap is not None:
        s = torch.tanh(s / feats.softcap) * feats.softcap
    if seg.bidirectional:  # an image's tokens see every key up to its end (window aside)
        keep = _in_window(keys - rows, rows, keys, feats.window, s.device)
    else:
        keep = visible(keys - rows, rows, 0, keys, feats.window, s.device)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one value-less logit per head (gpt-oss), dropped after softmax
        sink = sinks.float()[:, None, None].expand(-1, rows, 1)
        probs = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = s.softmax(-1)
    p = feats.dropout
    # The model draws on its probabilities' shape and dtype: all heads, query's dtype.
    kept = torch.empty(total_heads, rows, keys, dtype=q.dtype, device=q.device)
    kept = kept.bernoulli_(1 - p)
    if (heads.start, heads.stop) != (0, total_heads):
        kept = kept[heads].clone()  # autograd keeps this rank's heads only, not the draw
    out = torch.matmul(probs * kept / (1 - p), vs)
    return out.transpose(0, 1).to(v.dtype)


def _in_window(pos: int, rows: int, keys: int, window: int | None,
               device: torch.device) -> torch.Tensor:
    """``[rows, keys]``: key ``j`` within the window of the query at key position ``pos + i``
    (counted back from the query, as for a causal segment); every key without a window."""
    qp = torch.arange(pos, pos + rows, device=device)[:, None]
    kp = torch.arange(keys, device=device)[None, :]
    return kp > qp - window if window is not None else torch.ones_like(kp > qp)

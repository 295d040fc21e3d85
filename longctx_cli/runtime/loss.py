"""Summed cross-entropy over this rank's valid tokens.

The trainer divides by the exact global valid-token count itself, so these functions return
a *sum*, never a mean: a mean per rank or per micro-batch would weight short shards wrongly.

A plain linear head (the usual case) trains through `LinearCrossEntropy`: logits are built a
block of tokens at a time and the block's gradient is taken at once, so no `[tokens, vocab]`
tensor exists, nothing is recomputed, and one logits buffer serves every block. Other heads
(LoRA'd, quantized, FSDP2-sharded, a family's logit transform) and autocast take the
autograd path, whole or, with `chunked_loss`, in checkpointed chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from longctx_cli.constants import FUSED_LOSS_BLOCK_BYTES, IGNORE_INDEX
from longctx_cli.runtime.head import ModelHead

HALF_DTYPES = (torch.bfloat16, torch.float16)


def add_head_weight_grad(
    grad_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor, scratch: torch.Tensor | None,
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object] | None = None,
) -> None:
    """``grad_weight += g.T @ h`` for half-precision ``g`` ``[rows, vocab]`` and ``h``
    ``[rows, hidden]`` into a float32 ``grad_weight``: half inputs, float32 accumulation.

    On CUDA the product runs on the tensor cores with float32 output (:func:`half_mm_f32`), a
    vocabulary slice at a time into ``scratch`` (memory the caller no longer needs), then is
    added; elsewhere (or without scratch) the same numbers come from a float32 matmul of the
    half values (a product of two bf16 or two fp16 numbers is exact in float32).
    ``product(a, b, out)``: the sliced path's matmul (tests run it on CPU).
    """
    if scratch is None or (product is None and not g.is_cuda):
        grad_weight.addmm_(g.t().float(), h.float())
        return
    product = product or half_mm_f32
    rows = scratch.shape[0]
    for v0 in range(0, g.shape[1], rows):
        part = g[:, v0 : v0 + rows]
        out = scratch[: part.shape[1]]
        product(part.t(), h, out)
        grad_weight[v0 : v0 + rows].add_(out)


def half_mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16/fp16 matrices into float32 ``out`` (``aten::mm.dtype_out``, CUDA:
    PyTorch allows float32 output for fp16/bf16 inputs only; cuBLAS accumulates in float32)."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


class LinearCrossEntropy(torch.autograd.Function):
    """Sum of CE(hidden @ weight.T + bias, labels) over labels != -100, float32.

    The forward also computes the gradients of that sum with respect to `hidden`, `weight`
    and `bias` (the gradient of a block's CE with respect to its logits is softmax minus the
    one-hot label, made in place in the logits buffer); the backward only scales them by the
    incoming gradient, so they are exact for any loss scale or divisor applied after.

    The weight gradient's matmul. float32 weights: a float32 ``addmm``, bit for bit as
    always (cuBLAS runs it on TF32 tensor cores only when the user allows TF32, the ``tf32``
    key: ``torch.backends.cuda.matmul.allow_tf32``). bf16/fp16 weights (half-precision
    training): the block's logit gradient ``G`` is rounded to the weight's dtype (the copy
    the hidden gradient already uses) and ``G.T @ H`` runs with half inputs and float32
    accumulation (:func:`add_head_weight_grad`), on the tensor cores. The bound it keeps,
    elementwise, against the exact float64 gradient of the same half-precision ``H``:
    ``|dW - dW_exact| <= (u + n * 2**-24) * (|G|.T @ |H|)`` before the final cast to the
    weight's dtype (which adds ``u * |dW|``), with ``u`` the unit roundoff of the half type
    (``2**-8`` bf16, ``2**-11`` fp16, plus ``2**-25`` absolute per fp16 element below its
    normal range) and ``n`` the tokens summed. The float32 path it replaces kept ``G`` in
    float32 and still cast the result to the weight's dtype, so the difference is one
    rounding of ``G``, below the final cast's own error wherever the sum does not cancel.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, block: int) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        wide = torch.float32  # logits and their gradient, as the autograd path's `.float()`
        acc = torch.promote_types(weight.dtype, wide)  # the weight gradient's accumulator
        grad_hidden = (torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                       if need_hidden else None)
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if need_bias else None
        buffer = (torch.empty(min(block, hidden.shape[0]), weight.shape[0], dtype=wide,
                              device=hidden.device) if weight.dtype == wide else None)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for start in range(0, hidden.shape[0], block):
            y = labels[start : start + block]
            valid = y != IGNORE_INDEX
            if not bool(valid.any()):  # no loss and no gradient in this block
                continue
            h = hidden[start : start + block]
            if buffer is not None:
                logits = torch.mm(h, weight.t(), out=buffer[: h.shape[0]])
                if bias is not None:
                    logits.add_(bias)
            else:
                logits = F.linear(h, weight, bias).to(wide)
            target = y.clamp(min=0).unsqueeze(1)
            keep = valid.to(wide).unsqueeze(1)
            target_logit = logits.gather(1, target)
            # log-sum-exp with the exponentials kept in place: they become the softmax.
            peak = logits.amax(dim=1, keepdim=True)
            exps = logits.sub_(peak).exp_()
            sums = exps.sum(dim=1, keepdim=True)
            total += ((sums.log() + peak - target_logit) * keep).sum()
            # d(CE sum)/d(logits): softmax - one_hot(label) on valid rows, zero on the others.
            grad_logits = exps.mul_(keep / sums)
            grad_logits.scatter_add_(1, target, -keep)
            g = grad_logits.to(weight.dtype)
            if need_hidden:
                torch.mm(g, weight, out=grad_hidden[start : start + block])
            if need_bias:
                grad_bias += grad_logits.sum(0).to(acc)
            scratch = None
            if need_weight and weight.dtype in HALF_DTYPES and h.dtype == weight.dtype:
                # grad_logits is spent (g holds its half copy): its float32 memory becomes
                # the product's scratch, so the tensor-core path adds no buffer.
                width = h.shape[1]
                slice_rows = min(weight.shape[0], grad_logits.numel() // width)
                if slice_rows >= 1:
                    scratch = grad_logits.view(-1)[: slice_rows * width].view(slice_rows, width)
                add_head_weight_grad(grad_weight, g, h, scratch)
            elif need_weight:
                grad_weight.addmm_(grad_logits.t().to(acc), h.to(acc))
            # Drop this block's logits before the next block makes its own: held over, they
            # doubled the loss's peak (a [block, vocab] float32 and compute-dtype pair each).
            del logits, exps, grad_logits, g, scratch
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * grad_total).to(weight_dtype) if grad_weight is not None else None,
            (grad_bias * grad_total).to(bias_dtype) if grad_bias is not None else None,
            None, None,
        )


def fused_head(head: nn.Module, hidden: torch.Tensor) -> nn.Linear | None:
    """The plain `nn.Linear` behind `head` when `LinearCrossEntropy` computes exactly what
    `head` + CE would under autograd; None otherwise."""
    linear = head.lm_head if isinstance(head, ModelHead) else head
    if isinstance(head, ModelHead) and not head.transform.is_identity:
        return None
    if type(linear) is not nn.Linear or isinstance(linear.weight, DTensor):
        return None  # LoRA / quantized layers have their own forward; FSDP2 gathers in hooks
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        return None  # evaluation: the autograd path keeps no graph anyway
    if torch.is_autocast_enabled(hidden.device.type):
        return None  # autocast picks the matmul dtype; the autograd path follows it
    return linear


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
    is already shifted (label of position t is the token at t+1). A plain linear head runs
    fused (`LinearCrossEntropy`, in blocks of `chunk_size` tokens, else of
    `FUSED_LOSS_BLOCK_BYTES` of float32 logits). Otherwise, with `chunk_size`, lm_head and
    CE run chunk by chunk under activation checkpointing, so only one chunk's
    `[chunk, vocab]` logits exist at a time, in forward and in backward.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1)
    linear = fused_head(lm_head, hidden)
    if linear is not None:
        block = chunk_size or max(1, FUSED_LOSS_BLOCK_BYTES // (4 * linear.out_features))
        return LinearCrossEntropy.apply(hidden, linear.weight, linear.bias, shift_labels, block)
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

"""Megatron-style sequence parallelism (TP-sp) for Hugging Face decoders, composed with SP.

Tensor parallelism over a group of ``tp`` ranks with sequence-sharded activations, built on
``torch.distributed.tensor.parallel``: inside each decoder layer the norms run on a slice of
``1/tp`` of the rank's tokens (``SequenceParallel``); attention and the MLP start with an
all-gather of that slice (``PrepareModuleInput`` Shard(1) -> Replicate), run their column
parallel projections on the local heads / intermediate columns (``ColwiseParallel``) and end
with a reduce-scatter back to the sequence slice (``RowwiseParallel`` with
``output_layouts=Shard(1)``), i.e. Megatron's all-reduce split in two halves. Which
projections are column or row parallel comes from the model's own ``base_model_tp_plan``.

Composition with SP (the ``cp`` axis): the SP row shard of a rank (``S`` tokens) is what the
TP group shares; the embedding reduce-scatters it to ``S/tp`` tokens per TP rank. Attention
sees all ``S`` tokens of the SP shard again (after the all-gather) but only ``heads/tp``
query heads and ``kv_heads/tp`` KV heads, and the SP attention (ring, Ulysses, hybrid) works
on those local heads over the SP group.

The loss is vocab parallel: ``lm_head`` is split by vocabulary over the TP group and the
cross-entropy reduces max / sum-exp / target logit over the group, so no rank ever holds
logits over the whole vocabulary. Each TP rank sums the loss of its own ``S/tp`` tokens
(the loss of a row is split between the ranks of its TP group like it is split between the
ranks of its SP group), which keeps the trainer's exact token accounting unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from longctx_cli.constants import IGNORE_INDEX

from .mesh import ParallelState

# HF tp-plan styles we turn into sequence-parallel styles; anything else is refused.
# "replicated_with_grad_allreduce" marks a per-head norm inside attention (Qwen3's q_norm /
# k_norm): its weight is replicated, each rank normalises its own heads, and the weight's
# gradient is the sum over the TP group.
HEAD_NORM = "replicated_with_grad_allreduce"
SUPPORTED_STYLES = ("colwise", "rowwise", HEAD_NORM)


# ---------------------------------------------------------------------------------------
# the plan


def model_tp_plan(model_config: object) -> dict[str, str]:
    """The model's own `base_model_tp_plan` (decoder-relative names -> style); refuses
    families without one or with styles that have no sequence-parallel form here."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else (
        model_config)
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"model type `{getattr(text, 'model_type', '?')}` has no base_model_tp_plan in "
            "transformers, so tensor_parallel_size > 1 cannot shard it."
        )
    odd = sorted({s for s in plan.values() if s not in SUPPORTED_STYLES})
    if odd:
        raise ValueError(
            f"the model's tp plan uses styles {odd}; longctx's TP-sp supports only "
            f"{SUPPORTED_STYLES} (dense Llama-like decoders)."
        )
    return plan


class _HeadShardedNorm(SequenceParallel):
    """A norm over ``head_dim`` applied to ``[batch, seq, local heads, head_dim]``: torch's
    `SequenceParallel` with the heads (dim 2) as the sharded dimension, so the weight is
    replicated and DTensor knows its gradient is a partial sum over the group
    (`finish_partial_gradients` sums it). Any other input shape is refused at the first forward,
    never normalised wrongly."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=2, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        width = mod.weight.shape[-1]
        if isinstance(x, DTensor) or x.dim() != 4 or x.shape[-1] != width:
            raise ValueError(
                f"{type(mod).__name__} under tensor parallelism expects the local heads "
                f"[batch, seq, heads, head_dim={width}], got "
                f"{type(x).__name__} {tuple(x.shape)}; this model's per-head norm cannot "
                "be sharded by head."
            )
        return SequenceParallel._prepare_input_fn(sequence_sharding, mod, inputs, device_mesh)


class _Replicated(ParallelStyle):
    """A module whose parameters are replicated over the TP group and whose input already
    is a replicated DTensor (DTensor then sums the parameters' partial gradients)."""

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh)


def _layer_plan(layer: nn.Module, plan: dict[str, str]) -> dict[str, object]:
    """Parallel styles of one decoder layer (names relative to the layer)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, object] = {}
    blocks = set()
    for key, style in plan.items():
        if not key.startswith("layers.*."):
            raise ValueError(f"tp plan entry {key!r} is outside the decoder layers")
        name = key[len("layers.*."):]
        blocks.add(name.split(".")[0])
        if style == HEAD_NORM:
            styles[name] = _HeadShardedNorm()
            continue
        # Colwise keeps its default (replicated input, output sharded by head / column);
        # rowwise reduce-scatters along the sequence instead of all-reducing.
        base = ColwiseParallel() if style == "colwise" else RowwiseParallel(
            output_layouts=Shard(1))
        target = layer.get_submodule(name)
        if not hasattr(target, "lora_A"):
            styles[name] = base
            continue
        # A peft LoRA layer: the frozen base as above, and the adapter split so its output
        # has the base output's layout. Colwise site: x (replicated) -> A replicated -> B
        # split by output columns. Rowwise site: x (split by input columns) -> A split by
        # its input columns, reduce-scattered along the sequence (only r wide) -> B
        # replicated on the sequence slice, like a norm.
        styles[f"{name}.base_layer"] = base
        for adapter in target.lora_A:
            if style == "colwise":
                styles[f"{name}.lora_A.{adapter}"] = _Replicated()
                styles[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            else:
                styles[f"{name}.lora_A.{adapter}"] = RowwiseParallel(output_layouts=Shard(1))
                styles[f"{name}.lora_B.{adapter}"] = SequenceParallel(use_local_output=True)
    for block in sorted(blocks):
        # The block (attention, MLP) all-gathers the sequence slice of its input once. The
        # gathered input stays a DTensor, so the partial input gradients of its projections
        # (q, k, v; gate, up) add up first and leave in one reduce-scatter in backward.
        if block == "self_attn":
            styles[block] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        else:
            styles[block] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name, child in layer.named_children():
        if name in blocks:
            continue
        if not _is_norm(child):
            raise ValueError(
                f"decoder layer child `{name}` ({type(child).__name__}) is neither in the tp plan "
                "nor a norm; TP-sp does not know how to shard it."
            )
        styles[name] = SequenceParallel(use_local_output=True)
    return styles


def _is_norm(module: nn.Module) -> bool:
    params = dict(module.named_parameters())
    return "norm" in type(module).__name__.lower() and set(params) <= {"weight", "bias"} and all(
        p.dim() == 1 for p in params.values())


def apply_tensor_parallel(decoder: nn.Module, lm_head: nn.Module, tp: ParallelState,
                          model_config: object) -> None:
    """Shard the decoder (embedding, layers, final norm) and lm_head over the TP group.

    Afterwards every parameter is a DTensor on the tp mesh; one that is not would be trained
    from a partial gradient, so that is refused.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = model_tp_plan(model_config)
    tied = lm_head.weight is decoder.embed_tokens.weight
    # The styles re-create parameters as DTensors with requires_grad=True; a LoRA run's
    # frozen base (norms included) must stay frozen.
    frozen = {id(m): {n for n, p in m.named_parameters() if not p.requires_grad}
              for m in (decoder, lm_head)}
    for layer in decoder.layers:
        parallelize_module(layer, tp.tp_mesh, _layer_plan(layer, plan))
    top: dict[str, object] = {
        # Vocab-sharded embedding; its partial sums are reduce-scattered to the sequence slice.
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
    }
    parallelize_module(decoder, tp.tp_mesh, top)
    # lm_head gets [tokens, hidden] slices: all-gather them (reduce-scatter in backward) and
    # return logits of the local vocabulary columns.
    parallelize_module(lm_head, tp.tp_mesh, ColwiseParallel(
        input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=True))
    if tied:
        # Both styles split the [vocab, hidden] weight by rows (the vocabulary) over the same
        # mesh, so the two new DTensors hold the same shard: tie them again, so that the
        # embedding's and the head's gradients add up in one tensor, as in the model.
        lm_head.weight = decoder.embed_tokens.weight
    for module, where in ((decoder, "model"), (lm_head, "lm_head")):
        for name, param in module.named_parameters():
            if name in frozen[id(module)]:
                param.requires_grad_(False)
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"parameter `{where}.{name}` is not covered by the tensor-parallel plan; "
                    "its gradient would be partial. Refusing."
                )


# ---------------------------------------------------------------------------------------
# batches and loss


def tp_batch(batch, tp: ParallelState):
    """The TP rank's view of an SP-sharded batch: the same tokens (the embedding needs them
    all), but loss targets only for its own contiguous `1/tp` of them (the slice its
    residual stream holds), so token counts and loss sums partition the row exactly."""
    labels = batch.shift_labels
    if labels.shape[-1] % tp.layout.tp:
        raise ValueError(f"{labels.shape[-1]} local tokens do not split over tp {tp.layout.tp}")
    n = labels.shape[-1] // tp.layout.tp
    mine = slice(tp.tp_rank * n, (tp.tp_rank + 1) * n)
    successors = batch.next_tokens
    return replace(batch, shift_labels=labels[..., mine],
                   next_tokens=None if successors is None else successors[..., mine])


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over a group.

    Every rank returns the same per-token losses. The backward all-reduces the incoming
    per-token gradient first: each rank takes the loss of a different set of tokens, and the
    gradient of its vocabulary columns must include every rank's tokens.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                group: ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local_label = labels - vocab_start
        mine = (local_label >= 0) & (local_label < logits.shape[-1]) & (labels != IGNORE_INDEX)
        index = torch.where(mine, local_label, torch.zeros_like(local_label))
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target, group=group)
        loss = (sum_exp.log() - target) * (labels != IGNORE_INDEX)
        ctx.save_for_backward(exp, sum_exp, index, mine, labels != IGNORE_INDEX)
        ctx.group = group
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        exp, sum_exp, index, mine, valid = ctx.saved_tensors
        grad_loss = grad_loss.contiguous().clone()
        dist.all_reduce(grad_loss, group=ctx.group)
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, index.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None


def _gather_tokens(x: torch.Tensor, tp: ParallelState) -> torch.Tensor:
    """Non-differentiable all-gather along dim 0 (labels)."""
    out = x.new_empty((x.shape[0] * tp.layout.tp, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=tp.tp_group)
    return out


def _chunk_token_losses(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                        tp: ParallelState) -> torch.Tensor:
    """CE of each of this TP rank's tokens in the chunk (0 where the label is -100)."""
    all_labels = _gather_tokens(labels, tp)
    logits = head(hidden)  # [tp * chunk, vocab / tp], the input gathered by lm_head's plan
    vocab_start = tp.tp_rank * logits.shape[-1]
    losses = _VocabParallelCE.apply(logits, all_labels, vocab_start, tp.tp_group)
    n = labels.shape[0]
    return losses[tp.tp_rank * n : (tp.tp_rank + 1) * n]


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                tp: ParallelState) -> torch.Tensor:
    return _chunk_token_losses(head, hidden, labels, tp).sum()


def tp_token_losses(head: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor,
                    tp: ParallelState, chunk_size: int | None = None) -> torch.Tensor:
    """CE of every token of this TP rank's slice, vocab-parallel (what a preference loss
    sums per sequence); chunks as in `tp_loss_sum`, none skipped."""
    from torch.utils.checkpoint import checkpoint

    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1)
    step = hidden.shape[0] if chunk_size is None else max(1, chunk_size // tp.layout.tp)
    return torch.cat([checkpoint(_chunk_token_losses, head, hidden[s : s + step],
                                 labels[s : s + step], tp, use_reentrant=False)
                      for s in range(0, hidden.shape[0], step)])


def tp_loss_sum(head: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor,
                tp: ParallelState, chunk_size: int | None = None) -> torch.Tensor:
    """Sum of CE over this TP rank's tokens, vocab-parallel over the TP group.

    `hidden` `[tokens, hidden]` is the rank's sequence slice and `shift_labels` its targets.
    With `chunk_size`, chunks of the slice (the same chunk on every TP rank, so the
    collectives match) run under activation checkpointing: at most `tp * chunk` tokens of
    `vocab / tp` logits live at once.
    """
    from torch.utils.checkpoint import checkpoint

    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1)
    step = hidden.shape[0] if chunk_size is None else max(1, chunk_size // tp.layout.tp)
    total = hidden.sum().float() * 0.0  # keeps every rank's backward through the decoder
    for start in range(0, hidden.shape[0], step):
        chunk_labels = labels[start : start + step]
        # Decide the skip on the whole TP group's labels so the group stays in step.
        has_target = torch.tensor([float((chunk_labels != IGNORE_INDEX).any())])
        dist.all_reduce(has_target, group=tp.tp_group)
        if not has_target.item():
            continue
        total = total + checkpoint(_chunk_loss, head, hidden[start : start + step],
                                   chunk_labels, tp, use_reentrant=False)
    return total


def finish_partial_gradients(params: list[nn.Parameter]) -> None:
    """Sum over the TP group the gradients DTensor left as per-rank partial sums.

    A replicated parameter (norms, some LoRA matrices) used on a sequence slice gets a
    gradient that is still a per-rank partial sum (DTensor `Partial`); summing it now lets
    every consumer of `.grad` see the real gradient.
    """
    for p in params:
        if p.grad is not None and hasattr(p.grad, "placements") and (
                p.grad.placements != p.placements):
            p.grad = p.grad.redistribute(placements=p.placements)

"""Whole tiny Llama / Qwen2 models give the same logits and gradients with SP attention.

The reference is the model's own eager attention on the full row with a per-document
causal mask built here, so it shares no code with the SP path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.parallel import gather_sequence, register_sp_attention, shard_batch
from longctx_cli.parallel.sharding import IGNORE_INDEX
from tests.distributed import run_distributed
from tests.layouts import sp_state

TOL = 1e-5
DOCS = [13, 30, 1, 17]  # 61 tokens, padded by shard_batch; boundaries cross ranks


def tiny_model(arch: str, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    cfg = cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)  # same weights in every process and for every attention choice
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (sum(DOCS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX
    return ids, pos, labels


def reference(arch: str, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Eager attention, full row, additive per-document causal mask; sum of CE over targets."""
    model = tiny_model(arch, "eager")
    doc = torch.cumsum((pos == 0).long(), 0)
    t = ids.numel()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    logits = model(ids[None], position_ids=pos[None], attention_mask=mask[None, None]).logits[0]
    targets = torch.full_like(ids, IGNORE_INDEX)
    nxt_is_start = pos[1:] == 0
    targets[:-1] = torch.where(nxt_is_start, IGNORE_INDEX, ids[1:])
    F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sp_run(arch: str, ctx, checkpointing: bool) -> tuple[torch.Tensor, dict, int]:
    """Logits (gathered, padded row) and SP-summed parameter gradients through longctx_sp."""
    model = tiny_model(arch, register_sp_attention())
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    ids, pos, labels = packed_row()
    batch = shard_batch(ids, pos, labels, ctx)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta)
    logits = out.logits[0]
    loss = F.cross_entropy(
        logits, batch.shift_labels[0], ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if ctx.layout.sp > 1:
            dist.all_reduce(g, group=ctx.sp_group)  # each rank holds its tokens' share
        grads[name] = g
    full_logits = gather_sequence(logits.detach(), ctx)
    return full_logits, grads, batch.sp_meta.attention_calls


def compare(arch: str, ctx, checkpointing: bool) -> dict[str, float]:
    logits, grads, calls = sp_run(arch, ctx, checkpointing)
    ids, pos, _ = packed_row()
    ref_logits, ref_grads = reference(arch, ids, pos)
    t = ids.numel()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    grad_err = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    return {"logits": rel(logits[:t], ref_logits), "grads": grad_err, "calls": calls}


VARIANTS = [
    ("llama", "contiguous", False),
    ("llama", "zigzag", False),
    ("llama", "contiguous", True),
    ("qwen2", "contiguous", False),
    ("qwen2", "zigzag", False),
]


def parity_worker(rank: int, world_size: int) -> dict[str, dict]:
    results = {}
    for arch, layout, ckpt in VARIANTS:
        ctx = sp_state(sp=world_size, layout=layout, kernel="torch")
        results[f"{arch}/{layout}/ckpt={ckpt}"] = compare(arch, ctx, ckpt)
    return results


def check(results: dict[str, dict], layers: int = 2) -> None:
    for name, res in results.items():
        assert res["logits"] < TOL and res["grads"] < TOL, (name, res)
        # Recomputation under checkpointing calls attention again in backward.
        assert res["calls"] >= layers, (name, res)


def test_sp2_models_match_full_row_reference() -> None:
    for results in run_distributed(parity_worker, 2, timeout_s=240):
        check(results)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sp1_single_process_matches_reference(arch: str) -> None:
    ctx = sp_state(sp=1, kernel="torch")
    check({arch: compare(arch, ctx, checkpointing=False)})


def test_missing_sp_meta_fails_loudly() -> None:
    model = tiny_model("llama", register_sp_attention())
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(RuntimeError, match="sp_meta"):
        model(input_ids=ids, position_ids=torch.arange(8)[None])

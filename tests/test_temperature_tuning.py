"""Llama 4's NoPE-layer attention temperature tuning under SP and packing equals the model's
own training: loss and every gradient of a micro-batch of two packed rows, against Hugging
Face's eager forward of each row on its own (the index counts from the row's start).

`floor_scale` 8 and `attn_scale` 0.5, so the scales of rows of 24 and 39 tokens reach 5 and
change the loss (`test_the_scales_change_the_loss`); layers 1 and 3 are NoPE. At sp 1 and at
sp 2 (the llama3 ring contiguous and zigzag, Ulysses zigzag) in one run of 2 processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.parallel import ParallelState, register_sp_attention, shard_batch
from longctx_cli.parallel.attention import temperature_scale, true_index, true_temperature
from longctx_cli.parallel.sharding import IGNORE_INDEX
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state

TOL = 1e-5
FLOOR, ATTN_SCALE = 8, 0.5
ROWS = [(10, 14), (20, 19)]  # documents of each dataset row of the micro-batch
LAYOUTS = {"ring": {"layout": "contiguous"}, "ring zigzag": {"layout": "zigzag"},
           "ulysses zigzag": {"mode": "ulysses", "layout": "zigzag"}}


def tiny_model(attn: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(**{
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32,
        "intermediate_size_mlp": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 2,
        "no_rope_layers": [1, 0, 1, 0], "attn_temperature_tuning": True,
        "floor_scale": FLOOR, "attn_scale": ATTN_SCALE, "initializer_range": 0.2,
        **overrides})
    torch.manual_seed(0)  # the same weights in every process and for every attention
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def row(docs: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (sum(docs),), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in docs])
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX
    return ids, pos, labels


def reference(joined: bool = False, **overrides) -> tuple[float, dict]:
    """HF's eager forward of each row alone (`joined`: of the rows as one row), with a
    per-document causal mask; CE summed."""
    model = tiny_model("eager", **overrides)
    parts = [row(docs, seed) for seed, docs in enumerate(ROWS)]
    if joined:
        parts = [tuple(torch.cat(t) for t in zip(*parts, strict=True))]
    total = 0.0
    for ids, pos, _ in parts:
        doc = torch.cumsum((pos == 0).long(), 0)
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(len(ids), len(ids)).tril().bool()
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        masks = {kind: mask[None, None] for kind in ("full_attention", "chunked_attention")}
        logits = model(ids[None], position_ids=pos[None], attention_mask=masks).logits[0]
        targets = torch.where(torch.cat([pos[1:] == 0, torch.tensor([True])]), IGNORE_INDEX,
                              torch.roll(ids, -1))
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def longctx_run(ctx: ParallelState) -> tuple[float, dict]:
    """The micro-batch's rows concatenated, sharded with their starts, through longctx_sp."""
    model = tiny_model(register_sp_attention())
    parts = [row(docs, seed) for seed, docs in enumerate(ROWS)]
    ids, pos, labels = (torch.cat(t) for t in zip(*parts, strict=True))
    batch = shard_batch(ids, pos, labels, ctx, row_starts=(0, sum(ROWS[0])))
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                   sp_meta=batch.sp_meta).logits[0]
    loss = F.cross_entropy(logits, batch.shift_labels[0], ignore_index=IGNORE_INDEX,
                           reduction="sum")
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if ctx.layout.sp > 1:
        for t in (loss, *grads.values()):
            dist.all_reduce(t, group=ctx.sp_group)  # each rank holds its tokens' share
    return loss.item(), grads


def errors(ctx: ParallelState, ref: tuple[float, dict]) -> dict[str, float]:
    loss, grads = longctx_run(ctx)
    ref_loss, ref_grads = ref
    return {"loss": abs(loss - ref_loss) / abs(ref_loss),
            **{n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-12))
               for n, g in ref_grads.items()}}


def worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    ref = reference()
    return {name: errors(sp_state(sp=world_size, kernel="torch", **args), ref)
            for name, args in LAYOUTS.items()}


def _assert_exact(results: dict[str, dict[str, float]]) -> None:
    for name, errs in results.items():
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (name, worst, errs[worst])


def test_sp2_equals_each_rows_own_forward() -> None:
    for results in run_distributed(worker, 2, timeout_s=240):
        _assert_exact(results)


def test_sp1_packed_micro_batch_equals_each_rows_own_forward() -> None:
    _assert_exact({"sp1": errors(sp_state(sp=1, kernel="torch"), reference())})


def test_the_scales_change_the_loss() -> None:
    # The rows as one row (indices counted across both) and without tuning: both differ
    # from the rows' own forwards far beyond TOL, so the exact match above is earned.
    loss, _ = reference()
    for other in (reference(joined=True)[0], reference(attn_temperature_tuning=False)[0]):
        assert abs(other - loss) / loss > 1e-3, (other, loss)


def test_the_module_scale_is_replaced_by_the_true_one() -> None:
    # Rank 1 of sp 2, zigzag, rows starting at 0 and 24: the module scaled its 32 queries by
    # the scale of arange(32); the result carries the scale of each token's row index.
    ctx = rank_state(1, 2, layout="zigzag")
    pos = torch.cat([torch.arange(n) for n in ROWS[0] + ROWS[1]] + [torch.arange(1)])
    meta = shard_batch(pos, pos, pos, ctx, row_starts=(0, 24)).sp_meta
    index = true_index(meta)
    glob = torch.cat([torch.arange(a, b) for a, b in meta.local_ranges])
    assert torch.equal(index, torch.where(glob < 24, glob, glob - 24))
    module = tiny_model("eager").model.layers[1].self_attn  # a NoPE layer
    raw = torch.randn(1, 4, meta.local_len, 8)
    local = temperature_scale(torch.arange(meta.local_len), FLOOR, ATTN_SCALE)
    as_module = raw * local[:, None]
    out = true_temperature(module, as_module, meta)
    want = raw * temperature_scale(index, FLOOR, ATTN_SCALE)[:, None]
    torch.testing.assert_close(out, want, rtol=3e-7, atol=0)  # two float32 roundings
    assert (out - as_module).abs().max() > 0.1  # the module's own scale is wrong here
    rope = tiny_model("eager").model.layers[0].self_attn  # RoPE layers are left alone
    assert true_temperature(rope, as_module, meta) is as_module


def test_unknown_rows_are_refused_where_the_scale_differs() -> None:
    pos = torch.cat([torch.arange(n) for n in (10, 30)])
    meta = shard_batch(pos, pos, pos, ParallelState()).sp_meta  # row starts not given
    module = tiny_model("eager").model.layers[1].self_attn
    with pytest.raises(ValueError, match="floor_scale=8"):
        true_temperature(module, torch.randn(1, 4, 40, 8), meta)


def test_a_micro_batch_records_where_its_rows_start() -> None:
    from datasets import Dataset

    from longctx_cli.config import config_from_dict
    from longctx_cli.runtime.batches import micro_batches

    rows = Dataset.from_list([{"input_ids": r[0].tolist(), "position_ids": r[1].tolist(),
                               "labels": r[2].tolist()}
                              for r in (row(d, s) for s, d in enumerate(ROWS))])
    model = {"model_type": "llama4_text", "hidden_size": 32, "num_attention_heads": 4}
    lm = config_from_dict({"model_config": model, "tokenizer": "byte", "micro_batch_size": 2})
    (batch,) = micro_batches(rows, [0, 1], lm, ParallelState(), 0)
    assert batch.sp_meta.row_starts == (0, sum(ROWS[0]))
    assert not lm.objective.splits_rows
    pairs = config_from_dict({"model_config": model, "tokenizer": "byte", "rl": "dpo",
                              "datasets": [{"path": "x.jsonl", "type": "chatml.intel"}]})
    assert pairs.objective.splits_rows == "rl: dpo"  # its sequences are the model's rows
    (batch,) = micro_batches(rows, [0], pairs, ParallelState(), 0)
    assert batch.sp_meta.row_starts is None

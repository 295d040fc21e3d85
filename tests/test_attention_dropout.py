"""Attention dropout in training, as the model's own attention applies it (Seed-OSS: 0.1).

The reference is the model's own SDPA attention, which on CPU draws its dropout mask on the
math path: one Bernoulli draw over ``[1, heads, T, T]`` per layer. longctx draws the same
tensor for a one-document row (sp 1, and every rank of a Ulysses group, which keeps its own
heads), so under the same seed the training forward and every gradient agree with the
model's. Packed rows draw per document: there the rate is checked against the law of the
output (mean and variance over seeds), which fails with no dropout or another rate.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.parallel import (
    AttentionFeatures,
    gather_sequence,
    register_sp_attention,
    shard_batch,
    slice_sequence,
    sp_attention,
)
from longctx_cli.parallel.sharding import IGNORE_INDEX
from tests.attention_cases import DIM, doc_lengths_to_positions, make_inputs, rel_err
from tests.distributed import run_distributed
from tests.layouts import sp_state

P = 0.1
TOL = 1e-5
STANDIN = str(Path(__file__).parent / "flash_attn_standin")
TOKENS = 48  # one document: no padding at sp 2
PACKED = [10, 27, 5, 22]  # 64 tokens


def tiny_seed_oss(attn: str, heads: tuple[int, int] = (4, 2)) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, SeedOssConfig

    cfg = SeedOssConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=heads[0],
                        num_key_value_heads=heads[1],
                        head_dim=16, max_position_embeddings=256, attention_dropout=P,
                        residual_dropout=0.0)  # only attention dropout draws
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def one_document() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (TOKENS,), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(TOKENS)


def model_run(train: bool, seed: int, heads: tuple[int, int] = (4, 2)) -> tuple[torch.Tensor, dict]:
    """The model's own SDPA forward and backward on one document (sum of token CE)."""
    model = tiny_seed_oss("sdpa", heads).train(train)
    ids, pos = one_document()
    torch.manual_seed(seed)
    logits = model(ids[None], position_ids=pos[None]).logits[0]
    F.cross_entropy(logits[:-1], ids[1:], reduction="sum").backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def longctx_run(ctx, train: bool, seed: int, checkpointing: bool = False,
                heads: tuple[int, int] = (4, 2)) -> tuple[torch.Tensor, dict]:
    """The same through longctx_sp on ``ctx``: gathered logits, SP-summed gradients
    (``checkpointing``: each layer recomputed in backward, which must redraw its mask)."""
    model = tiny_seed_oss(register_sp_attention(), heads)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train(train)
    ids, pos = one_document()
    labels = ids.clone()
    labels[0] = IGNORE_INDEX
    batch = shard_batch(ids, pos, labels, ctx)
    torch.manual_seed(seed)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                   sp_meta=batch.sp_meta).logits[0]
    F.cross_entropy(logits, batch.shift_labels[0], ignore_index=IGNORE_INDEX,
                    reduction="sum").backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if ctx.layout.sp > 1:
            dist.all_reduce(g, group=ctx.sp_group)  # each rank holds its tokens' share
        grads[name] = g
    return gather_sequence(logits.detach(), ctx)[:TOKENS], grads


def errors(ctx, train: bool, seed: int, checkpointing: bool = False,
           heads: tuple[int, int] = (4, 2)) -> dict[str, float]:
    logits, grads = longctx_run(ctx, train, seed, checkpointing, heads)
    ref_logits, ref_grads = model_run(train, seed, heads)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    eval_logits, _ = model_run(False, seed, heads)
    return {"logits": rel(logits, ref_logits),
            "grads": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            "dropped": rel(ref_logits, eval_logits)}  # training differs from eval at all


def check(result: dict[str, float], train: bool) -> None:
    assert result["logits"] < TOL and result["grads"] < TOL, result
    if train:
        assert result["dropped"] > 1e-3, result  # the model did drop (the test has teeth)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_sp1_matches_the_model_with_and_without_dropout(train: bool) -> None:
    check(errors(sp_state(sp=1, kernel="torch"), train, seed=7), train)


def test_sp1_with_gradient_checkpointing_redraws_the_forwards_mask() -> None:
    check(errors(sp_state(sp=1, kernel="torch"), True, seed=7, checkpointing=True), True)


def test_sp1_training_draws_a_new_mask_per_seed() -> None:
    ctx = sp_state(sp=1, kernel="torch")
    a, _ = longctx_run(ctx, True, seed=1)
    b, _ = longctx_run(ctx, True, seed=2)
    assert float((a - b).norm() / a.norm()) > 1e-3


def _ulysses_worker(rank: int, world: int) -> dict[str, dict]:
    ctx = sp_state(sp=world, mode="ulysses", kernel="torch")
    return {"eval": errors(ctx, False, seed=7), "train": errors(ctx, True, seed=7)}


def _ulysses_attention_worker(rank: int, world: int, hq: int = 4, hkv: int = 2,
                              law: bool = True) -> dict[str, Any]:
    """Ulysses sp 2 against sp 1 on the same packed row and seed (each rank keeps its heads
    of the mask drawn for all of them, so the two agree), and the law of its output."""
    from longctx_cli.parallel import gather_sequence

    pos, _, q, k, v, dout = make_inputs(PACKED, hq, hkv, world, seed=9)
    ids = torch.zeros_like(pos)
    feats = AttentionFeatures(DIM**-0.5, dropout=P)
    results = []
    for ctx in (sp_state(sp=world, mode="ulysses", kernel="torch"), sp_state(sp=1)):
        meta = shard_batch(ids, pos, ids, ctx).sp_meta
        local = [slice_sequence(x, ctx).clone().requires_grad_() for x in (q, k, v)]
        out = _seeded(3, *local, meta, feats)
        out.backward(slice_sequence(dout, ctx))
        results.append([gather_sequence(t, ctx) for t in (out.detach(),
                                                         *(x.grad for x in local))])
    ulysses, single = results
    return {"same": max(rel_err(a, b) for a, b in zip(ulysses, single, strict=True)),
            "dropped": rel_err(single[0], _undropped(q, k, v, pos)),
            "law": law_errors(sp_state(sp=world, mode="ulysses", kernel="torch")) if law
            else None}


# ---- the law of the output over seeds (packed rows draw one mask per document) ----------

SEEDS = 100


def law_errors(ctx) -> dict[str, float]:
    """Over SEEDS draws of packed rows, with dropout P: the mean output against the undropped
    one, and the variance against ``p / (1 - p) * sum_j P_ij^2 v_j^2``, in standard errors."""
    lengths, hq, hkv = PACKED, 4, 2
    pos, _, q, k, v, _ = make_inputs(lengths, hq, hkv, ctx.layout.sp, seed=3)
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, doc_lengths_to_positions(lengths), ids, ctx).sp_meta
    local = [slice_sequence(x, ctx) for x in (q, k, v)]
    feats = AttentionFeatures(scale=DIM**-0.5)
    with torch.no_grad():
        plain = gather_sequence(sp_attention(*local, meta, feats), ctx)
        dropped = torch.stack([
            gather_sequence(_seeded(s, *local, meta, AttentionFeatures(DIM**-0.5, dropout=P)),
                            ctx) for s in range(SEEDS)])
    probs = _probabilities(q, k, pos)  # [H, T, T]
    vv = v.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [H, T, D]
    variance = (P / (1 - P) * torch.matmul(probs**2, vv**2)).transpose(0, 1)  # [T, H, D]
    mean_err = (dropped.mean(0) - plain) / (variance / SEEDS).sqrt().clamp_min(1e-12)
    var_ratio = dropped.var(0).sum() / variance.sum()
    return {"mean_z": float(mean_err.abs().mean()), "var_ratio": float(var_ratio)}


def _seeded(seed: int, q, k, v, meta, feats) -> torch.Tensor:
    torch.manual_seed(seed)
    return sp_attention(q, k, v, meta, feats)


def _probabilities(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    doc = torch.cumsum((pos == 0).long(), 0)
    t = pos.numel()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    return s.masked_fill(~allowed, float("-inf")).softmax(-1)


def check_law(result: dict[str, float]) -> None:
    # |z| of an unbiased mean averages sqrt(2 / pi) ~ 0.8; the variance of SEEDS draws is
    # within a few percent of its expectation. p = 0 gives ratio 0, 2p about 2.2.
    assert result["mean_z"] < 1.0, result
    assert 0.85 < result["var_ratio"] < 1.15, result


def test_sp1_packed_rows_drop_at_the_model_rate() -> None:
    check_law(law_errors(sp_state(sp=1, kernel="torch")))


def test_ulysses_sp2_draws_the_masks_of_sp1_and_drops_at_the_model_rate() -> None:
    for result in run_distributed(_ulysses_attention_worker, 2, timeout_s=240):
        assert result["same"] < TOL and result["dropped"] > 1e-2, result
        check_law(result["law"])


def _uneven_model_worker(rank: int, world: int) -> dict[str, float]:
    return errors(sp_state(sp=world, mode="ulysses", kernel="torch"), True, seed=7, heads=(6, 3))


def test_ulysses_sp2_with_uneven_heads_trains_as_the_models_own_sdpa() -> None:
    # The model's own forward and gradients under the same seed, its 6 heads split 4 and 2.
    for result in run_distributed(_uneven_model_worker, 2, timeout_s=240):
        check(result, train=True)


def test_ulysses_sp2_with_uneven_heads_draws_the_masks_of_sp1() -> None:
    # 3 KV-head groups of 2 over 2 ranks: rank 0 holds 4 query heads, rank 1 holds 2, and
    # each keeps its own heads' rows of the one mask drawn for all 6.
    for result in run_distributed(_ulysses_attention_worker, 2, 6, 3, False, timeout_s=240):
        assert result["same"] < TOL and result["dropped"] > 1e-2, result


@pytest.mark.slow  # the attention-level test above runs the same path by default
def test_ulysses_sp2_model_matches_the_model_in_training_and_eval() -> None:
    for result in run_distributed(_ulysses_worker, 2, timeout_s=240):
        check(result["eval"], train=False)
        check(result["train"], train=True)


# ---- the fused kernels, on their CPU stand-ins (the CUDA ops cannot run here) -------------

def _flash_worker(rank: int, world: int) -> dict[str, float]:
    sys.path.insert(0, STANDIN)  # this process only: flash-attn 2's stand-in
    import flash_attn  # noqa: F401  (the stand-in, or the test fails here)

    return errors(sp_state(sp=1, kernel="flash"), True, seed=7)


def test_flash_kernel_passes_the_dropout_to_flash_attn_as_the_model_does() -> None:
    """flash-attn's stand-in draws the SDPA math path's mask: the model's run, bit for bit."""
    (result,) = run_distributed(_flash_worker, 1, timeout_s=120)
    check(result, train=True)


@pytest.fixture
def torch_flash_standin():
    from longctx_cli.parallel.torch_flash import use_flash_ops
    from tests import torch_flash_standin as standin

    previous = use_flash_ops(standin.OPS)
    yield standin
    use_flash_ops(previous)


def test_torch_flash_kernel_drops_in_the_op_and_its_backward_redraws_the_mask(
        torch_flash_standin) -> None:
    standin = torch_flash_standin
    ctx = sp_state(sp=1, kernel="torch_flash")
    lengths, hq, hkv = PACKED, 4, 2
    pos, _, q, k, v, dout = make_inputs(lengths, hq, hkv, 1, seed=5)
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, pos, ids, ctx).sp_meta
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    calls = dict(standin.CALLS)
    torch.manual_seed(11)
    out = sp_attention(*leaves, meta, AttentionFeatures(DIM**-0.5, dropout=P))
    out.backward(dout)
    assert standin.CALLS["forward"] > calls["forward"]  # the op ran, not the math path
    assert standin.CALLS["backward"] > calls["backward"]
    torch.manual_seed(11)  # the op's seed, then each document's mask from it (the stand-in's)
    seed = int(torch.randint(0, 2**62, ()))
    full = [x.double().requires_grad_() for x in (q, k, v)]
    probs = _probabilities(full[0], full[1], pos)
    bounds = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
    kept = torch.zeros_like(probs)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        kept[:, a:b, a:b] = standin.keep_mask(seed, i, hq, b - a, b - a, P)
    vv = full[2].repeat_interleave(hq // hkv, 1).transpose(0, 1)
    want = torch.matmul(probs * kept / (1 - P), vv).transpose(0, 1)
    want.backward(dout.double())
    for a, b in zip((out, *(t.grad for t in leaves)), (want, *(t.grad for t in full)),
                    strict=True):
        assert rel_err(a.detach(), b.detach()) < TOL
    assert rel_err(out.detach(), _undropped(q, k, v, pos)) > 1e-2  # it did drop


def test_torch_flash_kernel_drops_at_the_model_rate(torch_flash_standin) -> None:
    check_law(law_errors(sp_state(sp=1, kernel="torch_flash")))


def _undropped(q, k, v, pos) -> torch.Tensor:
    vv = v.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(0, 1)
    return torch.matmul(_probabilities(q, k, pos), vv).transpose(0, 1)


def _ring_worker(rank: int, world: int) -> str:
    ctx = sp_state(sp=world, kernel="torch")
    pos = torch.arange(16)
    meta = shard_batch(torch.zeros_like(pos), pos, torch.zeros_like(pos), ctx).sp_meta
    q = torch.randn(8, 2, DIM)
    try:
        sp_attention(q, q, q, meta, AttentionFeatures(DIM**-0.5, dropout=P))
    except NotImplementedError as err:
        return str(err)
    return "ran"


def test_a_ring_refuses_dropout_on_the_ranks() -> None:
    for message in run_distributed(_ring_worker, 2, timeout_s=120):
        assert "needs whole rows of attention probabilities" in message


# ---- the fidelity probe judges the computation with dropout off ------------------------

def test_the_probe_passes_a_model_with_attention_dropout() -> None:
    from transformers import SeedOssConfig

    from longctx_cli.checks.fidelity import run_probe

    result = run_probe(SeedOssConfig(attention_dropout=P, residual_dropout=P))
    assert result.summary().startswith("passed: tiny random `seed_oss`"), result.summary()


def test_without_dropout_zeroes_the_rates_layers_keep_as_numbers() -> None:
    from longctx_cli.checks.fidelity import without_dropout

    model = without_dropout(tiny_seed_oss("sdpa").train())
    ids, pos = one_document()
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        runs.append(model(ids[None], position_ids=pos[None]).logits)
    assert torch.equal(*runs)
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)


# ---- evaluation during training runs the model in eval mode, as Hugging Face's does -----

def _eval_worker(rank: int, world: int) -> dict[str, Any]:
    from datasets import Dataset

    from longctx_cli.config import config_from_dict
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.train.evaluation import Evaluator

    model = tiny_seed_oss(register_sp_attention()).train()
    ids, pos = one_document()
    labels = ids.clone()
    labels[0] = IGNORE_INDEX
    rows = Dataset.from_list([{"input_ids": ids.tolist(), "position_ids": pos.tolist(),
                               "labels": labels.tolist()}])
    config = config_from_dict({"model_config": {"model_type": "seed_oss"}, "tokenizer": "byte",
                               "dtype": "float32", "eval_steps": 1, "val_set_size": 0.1})
    evaluator = Evaluator(config, sp_state(sp=1, kernel="torch"), model, None, rows, 0, None,
                          1, 1)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(evaluator.maybe_eval(0))
    reference, _ = model_run(False, 0)  # the model's own eval forward
    return {"losses": losses, "want": F.cross_entropy(reference[:-1], ids[1:]).item(),
            "training": model.training and decoder_and_head(model)[0].training}


def test_the_eval_loss_during_training_applies_no_dropout() -> None:
    (result,) = run_distributed(_eval_worker, 1, timeout_s=120)
    (a, b), want = result["losses"], result["want"]
    assert a == b and abs(a - want) < 1e-5 * want, result
    assert result["training"]  # training goes on with its dropout

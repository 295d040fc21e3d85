"""Ulysses over heads that do not divide its group (SmolLM2: 9 heads / 3 KV heads at sp 2).

The heads split by whole KV-head groups (``layout.head_split``: 9 / 3 at sp 2 is 6 and 3
query heads), by an all-to-all with split sizes. Checked here, at 2 gloo ranks: the exchange
is the same permutation of the elements (bit for bit); attention, forward and every input's
gradient, equals the dense float64 reference (packed rows, windows, softcap, sinks, spent
inputs, head chunks); a tiny Llama's loss and every parameter gradient equal the model's own
Hugging Face computation with ``labels=`` on each document, and so does what `longctx train`
runs over 3 optimizer steps (the family matrix's harness); and at 4 ranks, the replicated
split of 9 / 3 (2, 1, 3, 3) and hybrid 2 x 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx_cli.layout import head_split
from longctx_cli.parallel import (
    make_sp_meta,
    register_sp_attention,
    shard_batch,
    slice_sequence,
)
from longctx_cli.parallel.sharding import IGNORE_INDEX
from longctx_cli.parallel.ulysses import _heads_to_seq, _seq_to_heads, build_exchange
from tests.attention_cases import TOL, assert_all_close, rel_err, run_case
from tests.distributed import run_distributed
from tests.layouts import sp_state

LAYOUTS = ("contiguous", "zigzag")
DOCS = [10, 27, 5, 22]  # 64 tokens: documents cross the rank boundaries
# (query heads, KV heads): whole groups 6 + 3 and 4 + 2, MHA 3 + 2, one KV head replicated
# to both ranks with its 3 query heads split 2 + 1.
UNEVEN = ((9, 3), (6, 3), (5, 5), (3, 1))


def exchange_exact(ctx, hq: int, hkv: int) -> dict[str, bool]:
    """The uneven all-to-all, in token chunks: the head layout is the row's tokens in global
    order for this rank's heads, and back is the rank's own tokens, bit for bit."""
    split = head_split(hq, hkv, ctx.layout.sp)
    total = 40 * ctx.layout.sp
    ex = build_exchange(make_sp_meta(torch.arange(total), ctx), ctx.sp_group, ctx.layout.sp)
    full = torch.randn(total, hq, 3, generator=torch.Generator().manual_seed(hq))
    local = slice_sequence(full, ctx)
    mine = full[:, split.q_slice(ex.member)]
    exact = {}
    for chunks in (1, 3):
        for name, x in (("contiguous", local),
                        ("heads_major", local.transpose(0, 1).contiguous().transpose(0, 1))):
            heads = _seq_to_heads(x, ex, chunks, split.q_counts)
            back = _heads_to_seq(heads, ex, chunks, split.q_counts)
            exact[f"{hq}/{hkv}/chunks{chunks}/{name}"] = (
                torch.equal(heads, mine) and torch.equal(back, local))
    return exact


def attention_worker(rank: int, world_size: int) -> tuple[dict[str, dict], dict[str, bool]]:
    errors: dict[str, dict] = {}
    exact: dict[str, bool] = {}
    for layout in LAYOUTS:
        ctx = sp_state(sp=2, mode="ulysses", layout=layout, kernel="torch")
        for i, (hq, hkv) in enumerate(UNEVEN):
            name = f"{layout}/{hq}q{hkv}kv"
            errors[name] = run_case(ctx, DOCS, hq, hkv, seed=i)
            errors[f"{name}/spent"] = run_case(ctx, DOCS, hq, hkv, seed=i, spent=True)
            errors[f"{name}/window_softcap_sinks"] = run_case(ctx, DOCS, hq, hkv, i, 7, 1.5, True)
            exact.update({f"{layout}/{k}": v for k, v in exchange_exact(ctx, hq, hkv).items()})
        # 3 chunks of one KV head each: every chunk replicates its KV head to both ranks.
        chunked = sp_state(sp=2, mode="ulysses", layout=layout, kernel="torch", head_chunks=3)
        for i, (hq, hkv) in enumerate(UNEVEN[:2]):
            name = f"{layout}/{hq}q{hkv}kv/chunks3"
            errors[name] = run_case(chunked, DOCS, hq, hkv, i, 7, 1.5, True)
            errors[f"{name}/spent"] = run_case(chunked, DOCS, hq, hkv, seed=i, spent=True)
    return errors, exact


def test_uneven_heads_attention_matches_the_dense_reference() -> None:
    for errors, exact in run_distributed(attention_worker, 2, timeout_s=240):
        assert len(errors) == len(LAYOUTS) * (3 * len(UNEVEN) + 4)
        assert_all_close(errors)
        assert len(exact) == len(LAYOUTS) * len(UNEVEN) * 4
        assert all(exact.values()), [k for k, ok in exact.items() if not ok]


def flash_worker(rank: int, world_size: int) -> tuple[dict[str, dict], bool]:
    """The flash kernel's Ulysses (flash-attn's varlen call on the whole row, here its
    PyTorch stand-in) on the uneven heads, whole and in 3 head chunks."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "flash_attn_standin"))  # this process only
    errors: dict[str, dict] = {}
    for chunks in (1, 3):
        ctx = sp_state(sp=2, mode="ulysses", layout="contiguous", kernel="flash",
                       head_chunks=chunks)
        for i, (hq, hkv) in enumerate(UNEVEN):
            errors[f"chunks{chunks}/{hq}q{hkv}kv"] = run_case(ctx, DOCS, hq, hkv, i, 7, 1.5)
    return errors, "flash_attn" in sys.modules  # the stand-in ran


def test_uneven_heads_on_the_flash_kernel() -> None:
    for errors, called in run_distributed(flash_worker, 2, timeout_s=240):
        assert called and len(errors) == 2 * len(UNEVEN)
        assert_all_close(errors)


def four_rank_worker(rank: int, world_size: int) -> dict[str, dict]:
    """9 / 3 at sp 4 (KV head 0 replicated to two ranks: 2, 1, 3, 3 query heads), 6 / 6 at
    sp 4 (2, 2, 1, 1) and 9 / 3 in hybrid 2 x 2 (6 and 3 heads, each ring on its share)."""
    errors: dict[str, dict] = {}
    for mode, u in (("ulysses", None), ("hybrid", 2)):
        ctx = sp_state(sp=4, mode=mode, ulysses_degree=u, layout="zigzag", kernel="torch")
        for i, (hq, hkv) in enumerate(((9, 3), (6, 6))):
            errors[f"{mode}/{hq}q{hkv}kv"] = run_case(ctx, DOCS, hq, hkv, i, 7, 1.5, True)
    return errors


def test_uneven_heads_at_four_ranks_and_in_hybrid() -> None:
    for errors in run_distributed(four_rank_worker, 4, timeout_s=240):
        assert len(errors) == 4
        assert_all_close(errors)


# name -> (query heads, KV heads, sharding, head chunks)
MODELS = {
    "smollm2_9q3kv/zigzag": (9, 3, "zigzag", 1),
    "smollm2_9q3kv/contiguous/chunks3": (9, 3, "contiguous", 3),
    "mha_5q5kv/contiguous": (5, 5, "contiguous", 1),
}
MODEL_DOCS = [13, 30, 1, 17]  # 61 tokens, padded to the row multiple
PROMPT = 4  # the second document's first tokens are not trained (labels -100)


def tiny_llama(heads: int, kv_heads: int, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=8 * heads, head_dim=8, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=128)
    torch.manual_seed(0)  # the same weights in every process and for both attentions
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (sum(MODEL_DOCS),), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in MODEL_DOCS])
    labels = ids.clone()
    second = MODEL_DOCS[0]
    labels[second : second + PROMPT] = IGNORE_INDEX
    return ids, pos, labels


def hf_own(heads: int, kv_heads: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The model's own loss: each document through ``forward(labels=)`` (eager attention),
    weighted by its share of the row's targets, gradients summed over the documents."""
    model = tiny_llama(heads, kv_heads, "eager")
    ids, _, labels = row()
    bounds = torch.tensor([0, *MODEL_DOCS]).cumsum(0).tolist()
    docs = [(ids[a:b], labels[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    targets = [int((lab[1:] != IGNORE_INDEX).sum()) for _, lab in docs]
    total = 0.0
    for (doc, lab), n in zip(docs, targets, strict=True):
        if n:
            loss = model(input_ids=doc[None], labels=lab[None]).loss * (n / sum(targets))
            loss.backward()
            total += float(loss.detach())
    return total, {k: p.grad for k, p in model.named_parameters()}


def model_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors = {}
    for name, (heads, kv_heads, layout, chunks) in MODELS.items():
        ctx = sp_state(sp=2, mode="ulysses", layout=layout, kernel="torch", head_chunks=chunks)
        model = tiny_llama(heads, kv_heads, register_sp_attention())
        batch = shard_batch(*row(), ctx)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       sp_meta=batch.sp_meta).logits[0]
        targets = batch.shift_labels[0]
        count = (targets != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=ctx.sp_group)
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / count
        loss.backward()
        dist.all_reduce(loss := loss.detach(), group=ctx.sp_group)
        ref_loss, ref_grads = hf_own(heads, kv_heads)
        grad_errors = {}
        for key, p in model.named_parameters():
            dist.all_reduce(p.grad, group=ctx.sp_group)  # each rank holds its tokens' share
            grad_errors[key] = rel_err(p.grad, ref_grads[key])
        errors[name] = {"loss": abs(float(loss) - ref_loss) / ref_loss,
                        "grads": max(grad_errors.values()),
                        "params": float(len(grad_errors))}
    return errors


def training_worker(rank: int, world_size: int) -> dict[str, dict]:
    """What `longctx train` runs (the plan's rules, the fidelity probe, the trainer's step,
    3 optimizer steps of packed rows with accumulation) against the model's own training."""
    from tests.family_matrix import Family, compare, longctx_training, reference_training

    smollm2_heads = Family("llama 9q3kv", "llama", fields={
        "hidden_size": 72, "head_dim": 8, "num_attention_heads": 9, "num_key_value_heads": 3})
    reference = reference_training(smollm2_heads)
    ulysses = {"sequence_parallel_degree": 2, "sequence_parallel_mode": "ulysses"}
    runs = {name: longctx_training(smollm2_heads, settings)
            for name, settings in (("ulysses sp2", ulysses),
                                   ("ulysses sp2, 3 head chunks",
                                    {**ulysses, "ulysses_head_chunks": 3}))}
    # The final weights come back on rank 0.
    return {name: compare(run, reference) for name, run in runs.items()} if rank == 0 else {}


def llama_worker(rank: int, world_size: int) -> tuple[dict[str, dict], dict[str, dict]]:
    return model_worker(rank, world_size), training_worker(rank, world_size)


def test_uneven_heads_llama_equals_its_own_hugging_face_training() -> None:
    """SmolLM2's head shape (9 / 3) and MHA 5 / 5 at Ulysses sp 2 on a packed row with an
    untrained prompt: the loss and every parameter's gradient equal the model's own; and
    `longctx train`'s steps on 9 / 3 (whole, and in 3 head chunks) give its losses and
    final weights."""
    from tests.family_matrix import LOSS_TOL, WEIGHT_TOL

    results = run_distributed(llama_worker, 2, timeout_s=300)
    for errors, _ in results:
        assert set(errors) == set(MODELS)
        for name, e in errors.items():
            assert e["params"] == 2 * 9 + 3, (name, e)  # every parameter compared
            assert e["loss"] < TOL and e["grads"] < TOL, (name, e)
    training = results[0][1]
    assert len(training) == 2
    for name, got in training.items():
        assert "refused" not in got, (name, got)
        assert got["loss"] < LOSS_TOL and got["weights"] < WEIGHT_TOL, (name, got)

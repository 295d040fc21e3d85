"""Ulysses attention (torch kernel) equals single-process attention, exactly.

The cases and the dense float64 reference are the ring tests' (same rows, same documents
across rank boundaries, one-token documents, padding tail, GQA); here they run through the
all-to-all strategy at sp=4 and at dp=2 x sp=2, contiguous and zigzag, in one spawned run.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.parallel import make_sp_meta, shard_batch, slice_sequence, sp_attention
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.ulysses import (
    _heads_to_seq,
    _seq_to_heads,
    build_exchange,
    exchange_chunks,
    head_chunk_counts,
    head_split,
    seq_to_heads,
    usable_head_chunks,
)
from tests.attention_cases import (
    CASES,
    DIM,
    FEATURE_CASES,
    FEATURES,
    assert_all_close,
    feature_runs,
    rel_err,
    run_case,
)
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state

LAYOUTS = ("contiguous", "zigzag")


def strided_like_transformers(x: torch.Tensor) -> torch.Tensor:
    """The same values as the ``[T, H, D]`` view transformers hands over (heads-major memory)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def strided_input_matches(ctx: ParallelState) -> float:
    """Max difference between contiguous and heads-major inputs (must be exactly equal)."""
    lengths, hq, hkv = CASES["gqa_8q_2kv"]
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.zeros_like(pos)
    meta = shard_batch(ids, pos, ids, ctx).sp_meta
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(pos.numel(), h, DIM, generator=g) for h in (hq, hkv, hkv)]
    local = [slice_sequence(x, ctx) for x in full]
    a = sp_attention(*local, meta, DIM**-0.5)
    b = sp_attention(*(strided_like_transformers(x) for x in local), meta, DIM**-0.5)
    return float((a - b).abs().max())


def ulysses_worker(rank: int, world_size: int) -> dict[str, dict]:
    errors: dict[str, dict] = {}
    for sp in (world_size, 2):  # sp=4, then dp=2 x sp=2 on the same 4 processes
        for layout in LAYOUTS:
            ctx = sp_state(sp=sp, mode="ulysses", layout=layout, kernel="torch")
            for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
                errors[f"sp{sp}/{layout}/{name}"] = run_case(ctx, lengths, hq, hkv, seed=i)
                errors[f"sp{sp}/{layout}/{name}/spent"] = run_case(
                    ctx, lengths, hq, hkv, seed=i, spent=True
                )
            errors.update(feature_runs(ctx, f"sp{sp}/{layout}/features"))
            diff = strided_input_matches(ctx)
            errors[f"sp{sp}/{layout}/strided_input"] = {"max_abs_diff": diff}
    return errors


def test_ulysses_attention_matches_single_process() -> None:
    results = run_distributed(ulysses_worker, 4, timeout_s=240)
    per_run = 2 * len(CASES) + 1 + len(FEATURES) * len(FEATURE_CASES)
    assert len(results[0]) == 2 * len(LAYOUTS) * per_run
    for errors in results:  # every rank gathered the full tensors of its SP group
        assert_all_close(errors)


def head_chunked_worker(rank: int, world_size: int) -> dict[str, dict]:
    """Ulysses at sp 2 with the heads in 2 chunks (4 query heads: 2 a chunk, 1 a rank)."""
    errors: dict[str, dict] = {}
    for layout in LAYOUTS:
        ctx = sp_state(sp=2, mode="ulysses", layout=layout, kernel="torch", head_chunks=2)
        for i, (name, (lengths, hq, hkv)) in enumerate(CASES.items()):
            errors[f"{layout}/{name}"] = run_case(ctx, lengths, hq, hkv, seed=i)
            errors[f"{layout}/{name}/spent"] = run_case(ctx, lengths, hq, hkv, seed=i,
                                                        spent=True)
        errors.update(feature_runs(ctx, f"{layout}/features"))
    return errors


def test_head_chunked_ulysses_matches_single_process() -> None:
    """Chunked by heads, forward and backward (windows, softcap, sinks, GQA replicas
    included), Ulysses still equals the dense float64 reference."""
    results = run_distributed(head_chunked_worker, 2, timeout_s=240)
    assert len(results[0]) == len(LAYOUTS) * (2 * len(CASES) + len(FEATURES) * len(FEATURE_CASES))
    for errors in results:
        assert_all_close(errors)


@pytest.mark.parametrize(
    ("hq", "hkv", "size", "counts"),
    [(4, 4, 2, [1, 2]), (8, 2, 2, [1, 2]), (8, 2, 4, [1, 2]), (32, 8, 8, [1, 2, 4]),
     (28, 4, 4, [1]), (28, 4, 2, [1, 2]), (16, 16, 4, [1, 2, 4]), (8, 1, 4, [1]),
     (9, 3, 2, [1, 3]), (5, 5, 2, [1]), (12, 3, 4, [1, 3]), (3, 3, 4, [])],
)
def test_head_chunk_counts_keep_kv_groups_whole(hq: int, hkv: int, size: int,
                                                counts: list[int]) -> None:
    assert head_chunk_counts(hq, hkv, size) == counts


def test_a_layer_with_other_heads_runs_the_nearest_count_its_heads_allow() -> None:
    assert usable_head_chunks(4, 32, 8, 8) == 4
    assert usable_head_chunks(4, 8, 2, 2) == 2  # a narrower layer: 2 chunks
    assert usable_head_chunks(4, 8, 1, 4) == 1


@pytest.mark.parametrize(
    ("hq", "hkv", "size", "q_counts", "kv_index"),
    [(8, 8, 4, (2, 2, 2, 2), tuple(range(8))), (8, 2, 4, (2, 2, 2, 2), (0, 0, 1, 1)),
     (8, 1, 4, (2, 2, 2, 2), (0, 0, 0, 0)), (16, 4, 2, (8, 8), (0, 1, 2, 3)),
     (9, 3, 2, (6, 3), (0, 1, 2)), (9, 3, 4, (2, 1, 3, 3), (0, 0, 1, 2)),
     (5, 5, 2, (3, 2), tuple(range(5))), (3, 1, 2, (2, 1), (0, 0))],
)
def test_head_split_keeps_kv_groups_whole(hq: int, hkv: int, size: int,
                                          q_counts: tuple[int, ...],
                                          kv_index: tuple[int, ...]) -> None:
    """Each rank's query heads use only the KV heads it receives (GQA: query head h uses
    KV head h // (hq / hkv)), and every rank holds at least one head."""
    split = head_split(hq, hkv, size)
    assert split.q_counts == q_counts and split.kv_index == kv_index
    group, first_kv = hq // hkv, 0
    for rank in range(size):
        mine = range(hq)[split.q_slice(rank)]
        sent = kv_index[first_kv : first_kv + split.kv_counts[rank]]
        assert len(mine) >= 1 and sorted({h // group for h in mine}) == list(sent)
        first_kv += split.kv_counts[rank]


@pytest.mark.parametrize(
    ("hq", "hkv", "size", "message"),
    [(3, 3, 4, "give each of its 4 ranks one of the 3"), (8, 3, 4, "multiple of key/value heads")],
)
def test_head_split_refuses_a_rank_without_heads(hq: int, hkv: int, size: int,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        head_split(hq, hkv, size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exchange_puts_tokens_in_global_order(layout: str) -> None:
    """Pieces received from the 4 ranks, once reordered, tile the row in ascending order."""
    total = 64
    for rank in range(4):
        ctx = rank_state(sp_rank=rank, sp_size=4, mode="ulysses", layout=layout)
        ex = build_exchange(make_sp_meta(torch.arange(total), ctx), None, 4)
        assert ex.starts == tuple(range(0, total, ex.piece_len))
        assert ex.identity == (layout == "contiguous")


def exchange_worker(rank: int, world_size: int) -> dict[str, bool]:
    """The all-to-all in token chunks and written over its input: head layout = the row's
    tokens in global order for this rank's heads; back to the token layout = the rank's own
    tokens, bit for bit."""
    exact: dict[str, bool] = {}
    for sp in (world_size, 2):
        for layout in LAYOUTS:
            ctx = sp_state(sp=sp, mode="ulysses", layout=layout, kernel="torch")
            total, heads = 40 * sp, 2 * sp  # 40 tokens per rank: zigzag pieces of 20
            meta = make_sp_meta(torch.arange(total), ctx)
            ex = build_exchange(meta, ctx.sp_group, sp)
            full = torch.randn(total, heads, 3, generator=torch.Generator().manual_seed(sp))
            mine = full[:, ctx.sp_rank * 2 : ctx.sp_rank * 2 + 2]
            local = slice_sequence(full, ctx)
            for chunks in (1, 3, 7):
                for name, x in (("contiguous", local),
                                ("heads_major", strided_like_transformers(local))):
                    head_layout = _seq_to_heads(x, ex, chunks)
                    back = _heads_to_seq(head_layout, ex, chunks)
                    key = f"sp{sp}/{layout}/chunks{chunks}/{name}"
                    exact[key] = torch.equal(head_layout, mine) and torch.equal(back, local)
            # written over its input, as in a layer that reads it no more; the gradient of
            # sum(head layout * w) is w's rows of this rank's tokens, every head
            w = torch.randn(total, heads, 3, generator=torch.Generator().manual_seed(9))
            for name, layout_of in (("token_major", lambda t: t * 1),
                                    ("heads_major", strided_like_transformers)):
                leaf = local.clone().requires_grad_()
                x = layout_of(leaf)
                before = x._version
                head_layout = seq_to_heads(x, ex, spent=True)
                (head_layout * w[:, ctx.sp_rank * 2 : ctx.sp_rank * 2 + 2]).sum().backward()
                exact[f"sp{sp}/{layout}/spent/{name}"] = (
                    x._version > before and torch.equal(head_layout, mine)
                    and torch.equal(leaf.grad, slice_sequence(w, ctx))
                )
    return exact


def test_exchange_in_chunks_is_the_same_permutation() -> None:
    results = run_distributed(exchange_worker, 4, timeout_s=120)
    for exact in results:
        assert len(exact) == 2 * len(LAYOUTS) * (3 * 2 + 2)
        assert all(exact.values()), [k for k, ok in exact.items() if not ok]


def test_exchange_chunks_follow_the_bytes_moved() -> None:
    """Small tensors go in one piece; large ones in at most four chunks of at least a MiB."""
    assert exchange_chunks(torch.empty(64, 8, 32)) == 1
    assert exchange_chunks(torch.empty(2048, 4, 32)) == 1  # exactly 1 MiB
    assert exchange_chunks(torch.empty(4096, 4, 32)) == 2
    assert exchange_chunks(torch.empty(8192, 8, 32)) == 4
    assert exchange_chunks(torch.empty(8192, 8, 32, dtype=torch.bfloat16)) == 4
    assert exchange_chunks(torch.empty(3, 4096, 256)) == 3  # never more chunks than tokens


def llama_worker(rank: int, world_size: int) -> dict[str, dict]:
    """A tiny GQA Llama (4 heads, 2 KV heads) through ``longctx_sp`` vs the same model per document.

    Ulysses at sp=4 needs KV replication; hybrid 2x2 runs both halves. Weights are shared by
    seed; gradients are summed over the SP group, which is what the trainer's all-reduce does.
    """
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from longctx_cli.parallel import gather_sequence, register_sp_attention

    register_sp_attention()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    pos = torch.cat([torch.arange(n) for n in (20, 1, 45, 9)])  # 75 tokens: padded to 80
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (pos.numel(),), generator=g)
    errors: dict[str, dict] = {}
    for mode, u, layout in (("ulysses", 1, "zigzag"), ("hybrid", 2, "zigzag")):
        ctx = sp_state(
            sp=4, mode=mode, ulysses_degree=u, layout=layout, kernel="torch"
        )
        batch = shard_batch(ids, pos, ids, ctx)
        meta = batch.sp_meta
        weights = torch.randn(meta.total_len, 64, generator=g)

        model = copy.deepcopy(reference)
        model.config._attn_implementation = "longctx_sp"
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=meta
        ).logits[0]
        (logits * slice_sequence(weights, ctx)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for grad in grads:
            torch.distributed.all_reduce(grad, group=ctx.sp_group)

        reference.zero_grad()
        full_ids, full_pos = (
            x.reshape(-1)
            for x in (
                gather_sequence(batch.input_ids[0], ctx),
                gather_sequence(batch.position_ids[0], ctx),
            )
        )
        bounds = meta.cu_seqlens.tolist()
        ref_logits = torch.cat(
            [
                reference(input_ids=full_ids[a:b][None], position_ids=full_pos[a:b][None]).logits[0]
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        )
        (ref_logits * weights).sum().backward()
        ref_grads = [p.grad for p in reference.parameters()]
        errors[f"{mode}{u}/{layout}"] = {
            "logits": rel_err(gather_sequence(logits.detach(), ctx), ref_logits.detach()),
            "grads": max(rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True)),
        }
    return errors


@pytest.mark.slow  # Ulysses inside HF models: the family matrix trains every family with it
def test_inside_a_hugging_face_model() -> None:
    results = run_distributed(llama_worker, 4, timeout_s=300)
    for errors in results:
        assert len(errors) == 2
        assert_all_close(errors)


def attention_interface(*args, **kwargs):  # the name transformers' layers call
    return args[1], None


class ReadsNothingAfter(torch.nn.Module):
    def forward(self, q, k, v):
        q, k = q * 2, k * 2
        out, _ = attention_interface(self, q, k, v, None, scaling=1.0)
        return out + 1


class ReadsValueAfter(torch.nn.Module):
    def forward(self, q, k, v):
        out, _ = attention_interface(self, q, k, v, None)
        return out + v  # a value residual: v must still hold the values


class CallsInALoop(torch.nn.Module):
    def forward(self, q, k, v):
        out = q
        for _ in range(2):
            out, _ = attention_interface(self, out, k, v, None)
        return out


class CallsTwice(torch.nn.Module):
    def forward(self, q, k, v):
        a, _ = attention_interface(self, q, k, v, None)
        b, _ = attention_interface(self, a, k, v, None)
        return b


class PassesExpressions(torch.nn.Module):
    def forward(self, q, k, v):
        out, _ = attention_interface(self, q * 1, k, v, None)
        return out


@pytest.mark.parametrize(
    ("layer", "spent"),
    [(ReadsNothingAfter, True), (ReadsValueAfter, False), (CallsInALoop, False),
     (CallsTwice, False), (PassesExpressions, False), (torch.nn.Identity, False)],
)
def test_inputs_are_spent_only_where_the_layer_reads_them_no_more(layer: type, spent: bool) -> None:
    from longctx_cli.parallel.attention import attention_inputs_spent

    assert attention_inputs_spent(layer) is spent


def test_transformers_layers_hand_over_spent_inputs() -> None:
    """The families' attention layers read q, k and v no more after the attention call."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from longctx_cli.parallel.attention import attention_inputs_spent

    assert attention_inputs_spent(LlamaAttention) and attention_inputs_spent(Qwen3Attention)

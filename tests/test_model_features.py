"""Models whose attention has features (sliding windows, softcap, sinks) train exactly with SP.

Tiny random models built from their config classes, each feature active at the tested
length: Mistral (one window shorter than the documents), Qwen2 (``use_sliding_window`` with
``max_window_layers``: one full and one sliding layer), Gemma2 (attention and final logit
softcapping, alternating sliding layers), GPT-OSS (attention sinks, alternating sliding
layers, MoE). Through ``longctx_sp`` at sp=1 and at sp=2 (ring contiguous, ring zigzag,
Ulysses) they must give the logits and parameter gradients of the same model with
``attn_implementation="eager"`` run on each packed document separately, so that the
reference applies transformers' own window, softcap and sinks and shares no code with us.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_cli.parallel import gather_sequence, register_sp_attention, shard_batch, slice_sequence
from tests.distributed import run_distributed
from tests.layouts import sp_state

TOL = 1e-5
DOCS = [13, 30, 1, 17]  # 61 tokens, padded by shard_batch; boundaries cross ranks
WINDOW = 5  # shorter than three of the four documents
VOCAB = 96
FAMILIES = ("mistral", "qwen2_sliding", "gemma2", "gpt_oss")


def tiny_model(family: str, attn: str) -> torch.nn.Module:
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        GptOssConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        # Large weights so scores are large: softcaps and sinks change the result visibly.
        initializer_range=0.3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "mistral":
        cfg = MistralConfig(sliding_window=WINDOW, **common)
    elif family == "qwen2_sliding":
        cfg = Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common
        )
    elif family == "gemma2":
        cfg = Gemma2Config(
            sliding_window=WINDOW,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            query_pre_attn_scalar=8,
            **common,
        )
    elif family == "gpt_oss":
        cfg = GptOssConfig(
            sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1, **common
        )
    else:
        raise ValueError(family)
    torch.manual_seed(0)  # the same weights in every process and for every attention choice
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
    if family == "gpt_oss":
        with torch.no_grad():  # sinks big enough to take a real share of the softmax
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    return model


def packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, restarting positions and a fixed random weight per (token, vocab) logit."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (sum(DOCS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])
    weights = torch.randn(sum(DOCS), VOCAB, generator=g)
    return ids, pos, weights


def reference(family: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eager attention, one document at a time: transformers applies its own features."""
    model = tiny_model(family, "eager")
    ids, pos, weights = packed_row()
    bounds = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    logits = torch.cat(
        [
            model(input_ids=ids[a:b][None], position_ids=pos[a:b][None]).logits[0]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )
    (logits * weights).sum().backward()
    return logits.detach(), _grads(model)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for n, p in model.named_parameters()
    }


def sp_run(family: str, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gathered logits (unpadded) and SP-summed parameter gradients through ``longctx_sp``."""
    model = tiny_model(family, register_sp_attention())
    ids, pos, weights = packed_row()
    batch = shard_batch(ids, pos, ids, ctx)
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta
    ).logits[0]
    pad = batch.sp_meta.total_len - ids.numel()
    full_weights = torch.cat([weights, weights.new_zeros(pad, VOCAB)])
    (logits * slice_sequence(full_weights, ctx)).sum().backward()
    grads = _grads(model)
    if ctx.layout.sp > 1:
        for g in grads.values():
            dist.all_reduce(g, group=ctx.sp_group)  # each rank holds its tokens' share
    return gather_sequence(logits.detach(), ctx)[: ids.numel()], grads


def compare(family: str, ctx) -> dict[str, float]:
    logits, grads = sp_run(family, ctx)
    ref_logits, ref_grads = reference(family)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    worst = max(ref_grads, key=lambda n: rel(grads[n], ref_grads[n]))
    return {
        "logits": rel(logits, ref_logits),
        "grads": rel(grads[worst], ref_grads[worst]),
        "worst_param": worst,
    }


def check(results: dict[str, dict]) -> None:
    bad = {k: r for k, r in results.items() if not (r["logits"] < TOL and r["grads"] < TOL)}
    assert not bad, bad


SP2_VARIANTS = (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))


def sp2_worker(rank: int, world_size: int) -> dict[str, dict]:
    results = {}
    for mode, layout in SP2_VARIANTS:
        ctx = sp_state(sp=world_size, mode=mode, layout=layout, kernel="torch")
        for family in FAMILIES:
            results[f"{family}/{mode}/{layout}"] = compare(family, ctx)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_sp1_equals_the_eager_model(family: str) -> None:
    ctx = sp_state(sp=1, kernel="torch")
    check({family: compare(family, ctx)})


def test_sp2_equals_the_eager_model() -> None:
    for results in run_distributed(sp2_worker, 2, timeout_s=240):
        assert len(results) == len(FAMILIES) * len(SP2_VARIANTS)
        check(results)


def test_features_are_active_at_this_length() -> None:
    """Guard against a vacuous test: dropping each feature changes the eager model's logits."""
    import copy

    for family in FAMILIES:
        base, _ = reference(family)
        model = tiny_model(family, "eager")
        plain = copy.deepcopy(model.config)
        plain.sliding_window = 10_000  # longer than any document: no window in effect
        for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hasattr(plain, attr):
                setattr(plain, attr, None)
        stripped = type(model)(plain).float()
        stripped.load_state_dict(model.state_dict())
        if family == "gpt_oss":
            with torch.no_grad():
                for layer in stripped.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)  # a sink nothing reaches
        ids, pos, _ = packed_row()
        bounds = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
        with torch.no_grad():
            logits = torch.cat(
                [
                    stripped(input_ids=ids[a:b][None], position_ids=pos[a:b][None]).logits[0]
                    for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                ]
            )
        diff = float((logits - base).norm() / base.norm())
        assert diff > 1e-3, (family, diff)


def test_unknown_attention_arguments_are_refused() -> None:
    """An argument that might change the math is refused by name, never ignored."""
    from longctx_cli.parallel.attention import longctx_attention_forward

    ctx = sp_state(sp=1, kernel="torch")
    pos = torch.arange(8)
    meta = shard_batch(pos, pos, pos, ctx).sp_meta
    q = torch.randn(1, 2, 8, 4)
    layer = torch.nn.Linear(1, 1)
    out, _ = longctx_attention_forward(layer, q, q, q, None, 0.5, sp_meta=meta, use_cache=True)
    assert out.shape == (1, 8, 2, 4)
    with pytest.raises(ValueError, match="alibi_slopes"):
        longctx_attention_forward(layer, q, q, q, None, 0.5, sp_meta=meta, alibi_slopes=1)
    with pytest.raises(ValueError, match="is_causal"):
        longctx_attention_forward(layer, q, q, q, None, 0.5, sp_meta=meta, is_causal=False)


def test_a_non_causal_model_mask_is_refused() -> None:
    """Gemma3 with bidirectional attention: its mask lets queries see later keys."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        use_bidirectional_attention=True, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register_sp_attention())
    ctx = sp_state(sp=1, kernel="torch")
    ids, pos, _ = packed_row()
    batch = shard_batch(ids, pos, ids, ctx)
    with pytest.raises(ValueError, match="not causal"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sp_meta=batch.sp_meta)

"""Decoding after an SP prefill with the KV cache left sharded (`parallel/decode.py`,
`runtime/sampling.py`) returns exactly the tokens of the model's own single-process
`generate`: greedy for every strategy at sp 2 and 4, sampled (n sequences of one prompt from
one prefill, with temperature, top-k, top-p and repetition penalty) against
`generate(do_sample=True, num_return_sequences=n)` under the same seed, with the sampled
tokens' log-probabilities equal to the model's own forward; windowed models fall back to full
SP forwards with the same result."""

from __future__ import annotations

import copy

import pytest
import torch

from longctx_cli.parallel.decode import DecodeMeta, decode_attention
from longctx_cli.parallel.features import AttentionFeatures
from tests.distributed import run_distributed
from tests.layouts import rank_state, sp_state

PROMPT_LEN = 37  # not a multiple of any layout's row: the padding tail is in the cache
NEW = 10
MODEL = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "vocab_size": 97, "max_position_embeddings": 256, "initializer_range": 0.2,
}
LAYOUTS = [
    {"sp": 4, "layout": "stripe", "ring_attn_func": "batch_stripe"},
    {"sp": 4, "layout": "zigzag"},  # llama3 all-gather ring
    {"sp": 4, "ring_attn_func": "batch_zigzag"},
    {"sp": 4, "mode": "ulysses"},
    {"sp": 4, "mode": "hybrid", "ulysses_degree": 2},
    {"sp": 2, "layout": "stripe", "ring_attn_func": "batch_stripe"},  # two DP groups
    {"sp": 2, "mode": "ulysses"},
]


def _models(fields: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention

    cfg = AutoConfig.for_model(**fields)
    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    sp = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                          attn_implementation=register_sp_attention())
    sp.load_state_dict(reference.state_dict())
    return reference, sp.eval()


def _prompt(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist()


def _generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _decode_worker(rank: int, world: int, layouts: list[dict]) -> list[tuple]:
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import GREEDY, _decode_with_cache

    reference, model = _models(MODEL)
    decoder, head = decoder_and_head(model)
    results = []
    for i, layout in enumerate(layouts):
        state = sp_state(**layout)
        prompt = _prompt(i + 10 * state.dp_rank, MODEL["vocab_size"])
        got = _decode_with_cache(decoder, head, prompt, NEW, state, 0, torch.device("cpu"),
                                 (), GREEDY, 1, None).tokens[0]
        results.append((got, _generate(reference, prompt)))
    return results


def test_cached_decode_under_sp_equals_generate():
    results = run_distributed(_decode_worker, 4, LAYOUTS, timeout_s=240)
    for rank, per_rank in enumerate(results):
        for layout, (got, expected) in zip(LAYOUTS, per_rank, strict=True):
            assert got == expected, (rank, layout)
    # Not a trivial continuation: the random model's greedy tokens vary.
    assert len(set(results[0][0][1])) > 2


def _window_worker(rank: int, world: int) -> tuple:
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import greedy_tokens

    fields = {**MODEL, "model_type": "mistral", "sliding_window": 8}
    reference, model = _models(fields)
    decoder, head = decoder_and_head(model)
    prompt = _prompt(7, MODEL["vocab_size"])
    state = sp_state(sp=2, layout="stripe", ring_attn_func="batch_stripe")
    return greedy_tokens(decoder, head, prompt, NEW, state, 0, torch.device("cpu"), None), \
        _generate(reference, prompt)


def test_windowed_model_decodes_by_full_forwards_with_the_same_tokens():
    for got, expected in run_distributed(_window_worker, 2, timeout_s=180):
        assert got == expected


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_attention_is_softmax_over_visible_keys(softcap, sinks):
    """One process: masked prompt padding, decoded tokens, softcap and sinks against the dense
    formula written out."""
    torch.manual_seed(0)
    heads, kv_heads, dim, prompt, decoded = 4, 2, 8, 9, 3
    q = torch.randn(heads, dim)
    k, v = torch.randn(prompt + decoded, kv_heads, dim), torch.randn(prompt + decoded, kv_heads, 5)
    sink = torch.randn(heads) if sinks else None
    meta = DecodeMeta(rank_state(), torch.arange(prompt) < 7, decoded=decoded)
    feats = AttentionFeatures(scale=0.3, softcap=softcap)
    out = decode_attention(q[None], k[None], v[None], meta, feats, sink)[0]
    # The prompt's keys held out of the cache (shared by a batch of sequences): the same.
    meta.prompt_kv = ((k[:prompt], v[:prompt]),)
    held_out = decode_attention(q[None], k[None, prompt:], v[None, prompt:], meta, feats, sink,
                                layer=0)[0]
    torch.testing.assert_close(held_out, out, rtol=1e-6, atol=1e-6)

    keep = torch.cat([torch.arange(7), torch.arange(prompt, prompt + decoded)])
    kr = k[keep].repeat_interleave(heads // kv_heads, dim=1)
    vr = v[keep].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, kr) * 0.3
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if sinks:
        scores = torch.cat([scores, sink[:, None]], dim=1)
        vr = torch.cat([vr, torch.zeros(1, heads, 5)])
    expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), vr)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1}
SAMPLE_LAYOUTS = [{"sp": 1}, {"sp": 2, "layout": "zigzag"}, {"sp": 2, "mode": "ulysses"},
                  {"sp": 2, "layout": "stripe", "ring_attn_func": "batch_stripe"}]
N_SAMPLES, EOS = 4, 5


def _sample_worker(rank: int, world: int, layouts: list[dict], fields: dict) -> list:
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import Sampling, decode

    reference, model = _models(fields)
    decoder, head = decoder_and_head(model)
    sampling = Sampling(do_sample=True, **SAMPLING)
    results = []
    for layout in layouts:
        state = sp_state(**layout)
        prompt = _prompt(21, fields["vocab_size"])
        torch.manual_seed(1234)  # SP rank 0 samples from torch's global generator, as HF does
        got = decode(decoder, head, prompt, NEW, state, 0, torch.device("cpu"), (EOS,),
                     sampling, N_SAMPLES)
        torch.manual_seed(1234)
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=True,
                                 num_return_sequences=N_SAMPLES, pad_token_id=0,
                                 eos_token_id=EOS, **SAMPLING)
        expected = []
        for ids in out[:, len(prompt):].tolist():
            end = next((i + 1 for i, t in enumerate(ids) if t == EOS), len(ids))
            expected.append(ids[:end])
        # The recorded log-probabilities against the model's own forward (temperature-scaled).
        own = []
        for ids in got.tokens:
            full = torch.tensor([prompt + ids])
            with torch.no_grad():
                logits = reference(full).logits[0, len(prompt) - 1:-1] / SAMPLING["temperature"]
            own.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0])
        results.append((got.tokens, expected, got.logps, [o.tolist() for o in own]))
    return results


@pytest.mark.parametrize("model", ["llama", pytest.param("windowed", marks=pytest.mark.slow)])
def test_sampling_under_sp_equals_generate(model):
    """n samples from one prefill (the prompt's keys held once, shared by the n sequences)
    equal `generate(do_sample=True, num_return_sequences=n)` token for token; a windowed
    model samples by full SP forwards with the same tokens."""
    fields = dict(MODEL)
    layouts = SAMPLE_LAYOUTS
    if model == "windowed":
        fields.update(model_type="mistral", sliding_window=8)
        layouts = SAMPLE_LAYOUTS[:2]
    for per_rank in run_distributed(_sample_worker, 2, layouts, fields, timeout_s=240):
        for layout, (got, expected, logps, own) in zip(layouts, per_rank, strict=True):
            assert got == expected, layout
            for mine, theirs in zip(logps, own, strict=True):
                torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs),
                                           rtol=1e-4, atol=1e-5)
    assert len({tuple(t) for t in got}) > 1  # the samples differ: sampling, not greedy

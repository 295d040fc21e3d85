"""How fast GRPO's rollouts sample: longctx's decoder against the model's own `generate`, and
the time per generated token as the prompt grows, at sp 1, 2 and 4.

    python benchmarks/rollout.py                  # both parts, 3 runs each (~10 min, 2 cores)
    python benchmarks/rollout.py --part generate --runs 5
    python benchmarks/rollout.py --table benchmarks/results/rollout-<date>.json

Part `generate` (one process): a Llama from config (hidden 256, 4 layers, 8 heads / 2 KV
heads, vocabulary 8,192, float32) continues one prompt `G` times: `runtime.sampling.decode`
(what a rollout runs: one prefill, `G` sequences decoded against the shared prompt cache) and
`model.generate(do_sample=True, num_return_sequences=G)` with the same prompt, `G` and number
of new tokens (no end-of-sequence id, so both decode every token). Tokens per second = G x
new tokens / wall time, prefill included; the runs alternate, medians reported.

Part `length`: the same model decodes `G` sequences after prompts of 4K-32K tokens at sp 1, 2
and 4 (gloo processes, one thread each: on a 2-core machine sp 4 shares the cores). The time
per generated token is that of the N = 32 decode steps after the prefill (the sampler times
them itself), over N. Beside it, at sp 1, the model's own cached decoding of the `G` sequences
(the loop `generate` runs after prefilling `G` copies of the prompt), timed over N steps.
Writes benchmarks/results/rollout-<date>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, markdown_table, run_ranks, save_record

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "vocab_size": 8192, "max_position_embeddings": 65536}
G = 8


def models():
    """(plain HF model with sdpa, the same weights with longctx's SP attention), eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longctx_cli.parallel.attention import register_sp_attention

    torch.manual_seed(0)
    config = AutoConfig.for_model(**MODEL)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sp = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                          attn_implementation=register_sp_attention())
    sp.load_state_dict(plain.state_dict())
    return plain, sp.eval()


def prompt_of(length: int) -> list[int]:
    return torch.randint(1, MODEL["vocab_size"], (length,),
                         generator=torch.Generator().manual_seed(length)).tolist()


def timed_decode(decoder, head, prompt: list[int], new: int, state) -> tuple[float, float]:
    """(seconds in all, seconds of the decode steps after the prefill)."""
    from longctx_cli.runtime.sampling import Sampling, decode

    generator = torch.Generator().manual_seed(1) if state.sp_rank == 0 else None
    started = time.perf_counter()
    out = decode(decoder, head, prompt, new, state, 0, torch.device("cpu"), (),
                 Sampling(do_sample=True), G, generator)
    seconds = time.perf_counter() - started
    assert all(len(t) == new for t in out.tokens), [len(t) for t in out.tokens]
    return seconds, out.decode_seconds


def timed_generate(model, prompt: list[int], new: int) -> float:
    ids = torch.tensor([prompt])
    torch.manual_seed(1)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, do_sample=True, num_return_sequences=G, max_new_tokens=new,
                             min_new_tokens=new, eos_token_id=None, pad_token_id=0, top_k=0)
    seconds = time.perf_counter() - started
    assert out.shape == (G, len(prompt) + new), out.shape
    return seconds


def generate_part(rank: int, world: int, prompt_len: int, new: int, runs: int) -> dict:
    """longctx's decode and `generate` alternately, `runs` times each, at sp 1."""
    from longctx_cli.runtime.model import decoder_and_head
    from tests.layouts import sp_state

    torch.set_num_threads(1)
    state = sp_state(sp=1)
    plain, sp = models()
    decoder, head = decoder_and_head(sp)
    prompt = prompt_of(prompt_len)
    timed_decode(decoder, head, prompt, 4, state)  # warm-up both
    timed_generate(plain, prompt, 4)
    ours, theirs = [], []
    for _ in range(runs):
        ours.append(timed_decode(decoder, head, prompt, new, state)[0])
        theirs.append(timed_generate(plain, prompt, new))
    return {"longctx_s": ours, "generate_s": theirs}


def hf_per_token(model, prompt: list[int], new: int) -> float:
    """Seconds per token of the model's own cached decoding of `G` sequences after `prompt`
    (the loop `generate` runs after its prefill of `G` prompt copies), the prefill left out."""
    from longctx_cli.runtime.model import cache_kwargs

    ids = torch.tensor([prompt] * G)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        started = time.perf_counter()
        for _ in range(new):
            token = torch.multinomial(torch.softmax(logits.float(), -1), 1)
            out = model(input_ids=token, **cache_kwargs(model, cache))
            cache, logits = out.past_key_values, out.logits[:, -1]
    return (time.perf_counter() - started) / new


def length_part(rank: int, world: int, lengths: list[int], new: int, runs: int,
                plain_up_to: int) -> dict:
    """Seconds per generated token after each prompt length at sp `world` (the prefill
    taken out) and, at sp 1 up to `plain_up_to` tokens, the model's own."""
    from longctx_cli.runtime.model import decoder_and_head
    from tests.layouts import sp_state

    torch.set_num_threads(1)
    state = sp_state(sp=world)
    plain, sp = models()
    decoder, head = decoder_and_head(sp)
    out = {}
    for length in lengths:
        prompt = prompt_of(length)
        per_token, plain_per_token = [], []
        for _ in range(runs):
            # The first token comes from the prefill; the next `new` from decode steps.
            per_token.append(timed_decode(decoder, head, prompt, 1 + new, state)[1] / new)
            if world == 1 and length <= plain_up_to:
                plain_per_token.append(hf_per_token(plain, prompt, new))
        out[length] = {"longctx_s": per_token, "generate_s": plain_per_token}
    return out


def table(record: dict) -> str:
    """The markdown tables of a results record."""
    lines = []
    if "generate" in record:
        g = record["generate"]
        ours, theirs = statistics.median(g["longctx_s"]), statistics.median(g["generate_s"])
        tokens = G * g["new_tokens"]
        lines += [f"Sampling {G} continuations of one {g['prompt_tokens']:,}-token prompt, "
                  f"{g['new_tokens']} new tokens each, sp 1 (median of {len(g['longctx_s'])} "
                  "runs):", "",
                  markdown_table(["sampler", "tokens/s", "vs generate"], [
                      ["longctx rollout", f"{tokens / ours:,.0f}", f"{theirs / ours:.2f}x"],
                      ["`model.generate`", f"{tokens / theirs:,.0f}", "1.00x"]]), ""]
    if "length" in record:
        rows = record["length"]
        sps = sorted(rows, key=int)
        lengths = sorted(rows[sps[0]], key=int)
        cells = []
        for length in lengths:
            plain = rows[sps[0]][length]["generate_s"]
            cells.append([f"{int(length):,}",
                          f"{1000 * statistics.median(plain):.1f}" if plain else "-",
                          *(f"{1000 * statistics.median(rows[s][length]['longctx_s']):.1f}"
                            for s in sps)])
        lines += [f"Time per generated token (ms, median of {record['runs']} runs; {G} "
                  "sequences decoded together):", "",
                  markdown_table(["prompt tokens", "the model's own decoding",
                                  *(f"longctx sp {s}" for s in sps)], cells)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["generate", "length", "all"], default="all")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--plain-up-to", type=int, default=16384,
                        help="longest prompt the model's own decoding is timed at (it holds G "
                        "copies of the prompt's cache)")
    parser.add_argument("--table", type=Path, help="print the tables of a results file")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    # A part not run now keeps what today's file holds (each part says when it ran).
    today = RESULTS / f"rollout-{time.strftime('%Y-%m-%d')}.json"
    record: dict = json.loads(today.read_text()) if today.exists() else {}
    record.update({"model": MODEL, "num_generations": G, "runs": args.runs})
    if args.part in ("generate", "all"):
        result = run_ranks(generate_part, 1, args.prompt_tokens, args.new_tokens, args.runs,
                           timeout_s=3600)[0]
        record["generate"] = {"prompt_tokens": args.prompt_tokens,
                              "new_tokens": args.new_tokens, "ran": time.strftime("%H:%M"),
                              **result}
    if args.part in ("length", "all"):
        record["length"] = {}
        record["length_ran"] = time.strftime("%H:%M")
        for sp in args.sp:
            result = run_ranks(length_part, sp, args.lengths, 32, args.runs, args.plain_up_to,
                               timeout_s=3600)[0]
            record["length"][str(sp)] = {str(k): v for k, v in result.items()}
    print(table(record))
    save_record("rollout", record)


if __name__ == "__main__":
    main()

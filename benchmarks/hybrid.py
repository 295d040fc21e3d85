"""Hybrid models under SP on CPU: one training step per rank at sp 1, 2 and 4, next to a
pure-attention model of the same size.

    python benchmarks/hybrid.py --tokens 4096 --repeats 3

Four gloo processes, one compute thread each, start once. Every model has hidden 256, 4
layers, 4 heads of 64 (2 KV heads), vocab 4096, fp32; the hybrids keep one attention layer
and put their token mixer in the other three (Falcon-H1: a Mamba2 mixer beside attention in
every layer). Each layout fills the 4 ranks (sp 1: 4 data-parallel ranks; sp 4: one group),
so every rank is busy in every measurement. The step is the trainer's own code
(`build_model`, `shard_batch`, `forward_loss_sum`, backward, gradient sum over the SP group,
AdamW) on one packed row of documents of 1/8 to 1/2 of the row.

Reported per rank: wall seconds (slowest rank, median over repeats), compute-thread CPU
seconds (largest rank: the work a rank does, which is the step time with a core per rank;
the machine has fewer cores than ranks), and the peak resident-set growth during build +
step (largest rank). The transformers fallbacks in pure PyTorch compute the scans on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import (
    ROOT,
    cpu_model,
    markdown_table,
    peak_bytes,
    reset_peak,
    run_ranks,
    span,
    write_results,
)

from benchmarks.train_step import init_optimizer_state, synthetic_row
from longctx_cli.config import config_from_dict
from longctx_cli.config.plan import layout_for
from longctx_cli.parallel import build_parallel_state, shard_batch
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.model import build_model, decoder_and_head
from longctx_cli.train.objectives.causal_lm import forward_loss_sum

WORLD = 4
SIZE = {
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "pad_token_id": 0,
}
THREE_THEN_ATTENTION = 3
MODELS = {
    "llama (attention only)": {"model_type": "llama"},
    "lfm2 (3 conv + 1 attention)": {
        "model_type": "lfm2", "conv_L_cache": 3,
        "layer_types": ["conv"] * THREE_THEN_ATTENTION + ["full_attention"]},
    "olmo_hybrid (3 gated delta-net + 1 attention)": {
        "model_type": "olmo_hybrid", "eos_token_id": 1,
        "layer_types": ["linear_attention"] * THREE_THEN_ATTENTION + ["full_attention"],
        "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64},
    "falcon_h1 (Mamba2 beside attention x4)": {
        "model_type": "falcon_h1", "mamba_d_ssm": 256, "mamba_n_heads": 4, "mamba_d_head": 64,
        "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 256, "mamba_d_conv": 4},
}
SPS = (1, 2, 4)


def config_for(model: str, sp: int, tokens: int):
    return config_from_dict({
        "model_config": {**SIZE, **MODELS[model]},
        "dtype": "float32", "attention_kernel": "torch", "sequence_len": tokens,
        "sequence_parallel_degree": sp, "sp_sharding": "zigzag" if sp > 1 else None,
        "ring_attn_func": "varlen_llama3", "optimizer": "adamw",
    })


def step(model_name: str, sp: int, tokens: int, state,
         one_document: bool = False) -> tuple[float, float, float]:
    """Build and train one step on this rank: (wall s, peak growth bytes, CPU s)."""
    config = config_for(model_name, sp, tokens)
    gc.collect()
    base = reset_peak()
    model = build_model(config, state)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    init_optimizer_state(params, optimizer)
    ids, positions, labels = synthetic_row(tokens, SIZE["vocab_size"])
    if one_document:  # the scans' worst case: every rank reruns the prefix before it
        positions, labels = torch.arange(tokens), ids.clone()
        labels[0] = -100
    batch = shard_batch(ids, positions, labels, state, 0)
    count = torch.tensor([float(valid_token_count(batch.shift_labels))])
    if state.sp_group is not None:
        dist.all_reduce(count, group=state.sp_group)
    start, cpu_start = time.perf_counter(), time.thread_time()
    loss = forward_loss_sum(decoder, head, batch, config, state)
    (loss / count).backward()
    if state.sp_group is not None:
        for p in params:
            dist.all_reduce(p.grad, group=state.sp_group)
    optimizer.step()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    grown = peak_bytes() - base
    del model, decoder, head, params, optimizer, batch, loss
    return elapsed, float(grown), cpu


def machine_line() -> str:
    """The CPU's model name and core count (what the timings depend on)."""
    return f"{cpu_model() or platform.machine()}, {os.cpu_count()} cores"


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    states = {sp: build_parallel_state(layout_for(config_for(next(iter(MODELS)), sp, 512),
                                                  WORLD, None)) for sp in SPS}
    results = []
    for model_name in MODELS:
        step(model_name, 1, 512, states[1])  # imports and one-off allocations
        for sp in SPS:
            runs = []
            for _ in range(args.repeats):
                stats = torch.tensor(step(model_name, sp, args.tokens, states[sp],
                                          args.one_document), dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                runs.append(stats.tolist())
            row = {"model": model_name, "sp": sp, "tokens": args.tokens,
                   "wall_s": [r[0] for r in runs], "peak_mib": [r[1] / 2**20 for r in runs],
                   "cpu_s": [r[2] for r in runs]}
            results.append(row)
            if rank == 0:
                print(f"{model_name:48s} sp{sp}: wall {statistics.median(row['wall_s']):.2f}s "
                      f"cpu {statistics.median(row['cpu_s']):.2f}s "
                      f"peak {statistics.median(row['peak_mib']):.0f} MiB", flush=True)
    return results


def table(results: list[dict]) -> str:
    """Markdown: per model and sp, the range over repeats of the slowest rank's wall seconds,
    the busiest rank's compute-thread CPU seconds and the largest peak growth per rank, and
    the medians' ratio to the attention-only model at the same sp."""
    base = {r["sp"]: r for r in results if r["model"] == next(iter(MODELS))}
    rows = []
    for r in results:
        b = base[r["sp"]]
        cpu = statistics.median(r["cpu_s"]) / statistics.median(b["cpu_s"])
        peak = statistics.median(r["peak_mib"]) / statistics.median(b["peak_mib"])
        rows.append([r["model"], r["sp"], span(r["wall_s"], ".2f"), span(r["cpu_s"], ".2f"),
                     f"{cpu:.2f}", span(r["peak_mib"], ".0f"), f"{peak:.2f}"])
    return markdown_table(["model", "sp", "step wall s", "step CPU s per rank",
                           "CPU / attention-only", "peak MiB per rank", "peak / attention-only"],
                          rows)


DOC = ROOT / "docs" / "parallelism.md"
MARKERS = ("<!-- hybrid-bench:start -->", "<!-- hybrid-bench:end -->")


def docs_section(paths: list[Path]) -> str:
    """The text between the markers in docs/parallelism.md, markers included: the tables of
    results files."""
    parts = []
    for path in paths:
        payload = json.loads(path.read_text())
        parts.append(
            f"Scans: {payload['scans']}. "
            f"{payload.get('row', 'packed documents').capitalize()} per row, "
            f"{payload['results'][0]['tokens']} tokens ({payload['repeats']} repeats per cell, "
            f"`{path.relative_to(DOC.parents[1])}`; {payload['machine']}, {payload['world']} "
            f"ranks of one thread):\n\n{table(payload['results'])}")
    return f"{MARKERS[0]}\n" + "\n\n".join(parts) + f"\n{MARKERS[1]}"


def write_docs(paths: list[Path]) -> None:
    """Put the tables of results files between the markers in docs/parallelism.md."""
    text = DOC.read_text()
    head, rest = text.split(MARKERS[0])
    _, tail = rest.split(MARKERS[1])
    DOC.write_text(head + docs_section(paths) + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/hybrid.json")
    parser.add_argument("--one-document", action="store_true",
                        help="one document per row (default: packed documents of 1/8 to 1/2 "
                        "of the row)")
    parser.add_argument("--docs", type=Path, nargs="+", metavar="RESULTS.json",
                        help="only write these results files' tables into docs/parallelism.md")
    args = parser.parse_args()
    if args.docs:
        write_docs([p.resolve() for p in args.docs])
        return
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    results = run_ranks(worker, WORLD, args)[0]
    write_results(args.out, {
        "size": SIZE, "models": MODELS, "world": WORLD, "threads_per_rank": 1,
        "machine": machine_line(), "repeats": args.repeats,
        "row": "one document" if args.one_document else "packed documents",
        "scans": "state passed from rank to rank (zigzag rows)", "results": results})
    print(table(results))


if __name__ == "__main__":
    main()

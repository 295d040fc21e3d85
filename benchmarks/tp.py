"""TP-sp vs sequence parallelism: one training step per layout at equal world size (CPU, gloo).

    nice python benchmarks/tp.py --tokens 8192 --repeats 3

The model, synthetic row, memory probe and optimizer warm-up are `benchmarks/train_step.py`'s
(a 4-layer Llama, hidden 256, 4 heads of 64, 2 KV heads, vocab 4096, fp32). Four gloo ranks
with one compute thread each start once; a layout of world W runs on ranks 0..W-1 while the
others wait, and layouts are interleaved in a rotated order every round. Compared:

    world 2: sp2 ring, sp2 ulysses, tp2          world 4: sp4 ring, tp2 x sp2 (ring)

Each step runs the trainer's code (`build_model` with the TP plan, `shard_batch`,
`forward_loss_sum`), sums gradients over the ranks that hold the same weights, and steps
AdamW. The table adds the communication volume each layout implies per rank and step
(analytic, from the collectives the code issues; see `comm_bytes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from common import markdown_table, peak_bytes, reset_peak, rounds, write_results

from benchmarks import train_step as ts  # the shared helpers of the train-step benchmark
from longctx_cli.config import config_from_dict
from longctx_cli.config.shape import ModelShape
from longctx_cli.layout import Layout
from longctx_cli.parallel import build_parallel_state, shard_batch
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.model import build_model, decoder_and_head, model_config_of
from longctx_cli.train.objectives.causal_lm import forward_loss_sum
from longctx_cli.train.step import sum_gradients

LAYOUTS = {  # name -> (tp, sp, mode)
    "sp1": (1, 1, "ring"),
    "sp2_ring": (1, 2, "ring"),
    "sp2_ulysses": (1, 2, "ulysses"),
    "tp2": (2, 1, "ring"),
    "sp4_ring": (1, 4, "ring"),
    "tp2_sp2_ring": (2, 2, "ring"),
}
CONTEXTS: dict = {}


def layout_config(name: str, tokens: int):
    tp, sp, mode = LAYOUTS[name]
    return config_from_dict({
        "model_config": ts.MODEL, "dtype": "float32", "attention_kernel": "torch",
        "sequence_len": tokens, "sequence_parallel_degree": sp, "sequence_parallel_mode": mode,
        "tensor_parallel_size": tp, "optimizer": "adamw",
    })


def comm_bytes(name: str, tokens: int, bytes_per: int = 4) -> dict[str, float]:
    """Bytes each rank sends per step, by kind (ring algorithms: (n-1)/n of the buffer).

    ring SP, per layer: all-gather K,V in forward, again in backward, reduce-scatter dK,dV.
    Ulysses, per layer: all-to-all of q,k,v and of the output, forward and backward.
    TP-sp, per layer: all-gather + reduce-scatter of [tokens, hidden] around attention and
    around the MLP, forward and backward (8 transfers); plus the embedding's reduce-scatter
    and lm_head's all-gather (x2 for backward). Weight gradients: all-reduce (2(n-1)/n) over
    the ranks holding the same weights; TP shards the weights, so only the SP ranks do.
    """
    tp, sp, mode = LAYOUTS[name]
    shape = ModelShape.from_hf_config(model_config_of(layout_config(name, tokens)))
    h, kv, d, hidden = (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                        shape.hidden_size)
    layers = shape.num_hidden_layers
    shard = tokens // sp  # tokens of one SP shard (what a TP group shares)
    out = {"attention (SP)": 0.0, "activations (TP)": 0.0, "weight grads": 0.0}
    if sp > 1:
        f = (sp - 1) / sp
        kv_local = 2 * (kv // tp) * d
        if mode == "ring":
            out["attention (SP)"] = layers * 3 * f * tokens * kv_local * bytes_per
        else:
            qkvo = (2 * (h // tp) + 2 * (kv // tp)) * d
            out["attention (SP)"] = layers * 2 * f * shard * qkvo * bytes_per
    if tp > 1:
        f = (tp - 1) / tp
        out["activations (TP)"] = (layers * 8 + 3) * f * shard * hidden * bytes_per
    params = shape.parameter_count() / tp
    if sp > 1:
        out["weight grads"] = 2 * (sp - 1) / sp * params * bytes_per
    out["total"] = sum(out.values())
    return out


def build_contexts() -> None:
    """Every layout's groups; new_group is collective, so every rank builds all of them."""
    world = dist.get_world_size()
    for name, (tp, sp, mode) in LAYOUTS.items():
        if tp == 1:
            ctx = build_parallel_state(Layout.filling(world, sp=sp, mode=mode, kernel="torch"))
        else:
            # The mesh covers the world: ranks beyond the layout form other (idle) TP groups.
            ctx = build_parallel_state(Layout.filling(world, sp=sp, mode=mode, kernel="torch",
                                                      tp=tp))
        CONTEXTS[name] = ctx


def run_step(name: str, tokens: int) -> tuple[float, float] | None:
    tp, sp, _ = LAYOUTS[name]
    if dist.get_rank() >= tp * sp:
        return None
    config = layout_config(name, tokens)
    ctx = CONTEXTS[name]
    base = reset_peak()
    model = build_model(config, ctx)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ts.init_optimizer_state(params, optimizer)
    batch = shard_batch(*ts.synthetic_row(tokens, ts.MODEL["vocab_size"]), ctx, 0)
    count = torch.tensor([float(valid_token_count(batch.shift_labels))])
    start = time.perf_counter()
    loss = forward_loss_sum(decoder, head, batch, config, ctx)
    (loss / count).backward()
    if ctx.layout.tp > 1:
        # The TP partial sums, then the sum over this layout's SP ranks (not the idle ones).
        sum_gradients(params, dataclasses.replace(ctx, replica_group=ctx.sp_group))
    elif ctx.sp_group is not None:
        for p in params:
            dist.all_reduce(p.grad, group=ctx.sp_group)
    optimizer.step()
    elapsed = time.perf_counter() - start
    grown = peak_bytes() - base
    del model, decoder, head, params, optimizer, batch, loss
    return elapsed, float(grown)


def measure(name: str, tokens: int) -> tuple[float, float]:
    got = run_step(name, tokens) or (0.0, 0.0)
    stats = torch.tensor(got, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), float(stats[1]) / 2**20


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    build_contexts()
    for name in LAYOUTS:
        measure(name, 512)  # warm-up: one-off allocations and imports
    names = list(LAYOUTS)
    results = []
    for tokens in args.tokens:
        times: dict[str, list[float]] = {n: [] for n in names}
        peaks: dict[str, list[float]] = {n: [] for n in names}
        for r, name in rounds(names, args.repeats, stride=2):
            t, mib = measure(name, tokens)
            times[name].append(t)
            peaks[name].append(mib)
            if rank == 0:
                print(f"  {tokens:>6} {name:<14} round {r}: {t:6.2f}s {mib:7.0f} MiB", flush=True)
        for name in names:
            tp, sp, mode = LAYOUTS[name]
            results.append({
                "tokens": tokens, "layout": name, "world": tp * sp, "tp": tp, "sp": sp,
                "mode": mode, "times_s": times[name],
                "median_s": statistics.median(times[name]),
                "peak_mib": statistics.median(peaks[name]),
                "comm_mib": {k: v / 2**20 for k, v in comm_bytes(name, tokens).items()},
            })
    return results


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        c = r["comm_mib"]
        rows.append([r["tokens"], r["layout"], r["world"], f"{r['median_s']:.2f}",
                     f"{r['peak_mib']:.0f}", f"{c['attention (SP)']:.1f}",
                     f"{c['activations (TP)']:.1f}", f"{c['weight grads']:.1f}",
                     f"{c['total']:.1f}"])
    return markdown_table(["tokens", "layout", "world", "median step (s)", "peak/rank (MiB)",
                           "comm/rank/step (MiB): attention SP", "activations TP",
                           "weight grads", "total"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tp.json")
    args = parser.parse_args()
    results = ts.spawn_ranks(worker, args)
    write_results(args.out, {"model": ts.MODEL, "threads_per_rank": 1, "world": ts.WORLD,
                             "results": results})
    print(table(results))


if __name__ == "__main__":
    main()

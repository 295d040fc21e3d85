"""One full training step (forward, backward, gradient sum, AdamW) per variant, on CPU + gloo.

    python benchmarks/train_step.py --tokens 8192 16384 --repeats 3

A small Llama (4 layers, hidden 256, 4 heads of 64, 2 KV heads, vocab 4096, fp32) trains on
one packed synthetic row. Four gloo processes with one compute thread each start once; a
variant with sp ranks runs on ranks 0..sp-1 while the others wait in a barrier, so sp=1 and
sp=2 are timed side by side on the same loaded machine. Variants run in a rotated order in
every round; time is the median over rounds of the slowest rank.

Each step drives the trainer's own code: `build_model`, `apply_tiled_mlp`, `shard_batch`,
`forward_loss_sum` (decoder + `lm_loss_sum`) and `activation_offload`, then sums gradients
over the SP group and steps AdamW. Memory is the rank's resident-set high-water mark during
build + step (the kernel's VmHWM, reset through /proc/self/clear_refs) minus its resident set
just before the model is built: parameters, gradients, optimizer state and activations.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from common import markdown_table, peak_bytes, reset_peak, rounds, run_ranks, write_results

from longctx_cli.config import Config, config_from_dict
from longctx_cli.config.memory_estimate import estimate_memory
from longctx_cli.config.plan import layout_for
from longctx_cli.config.shape import ModelShape
from longctx_cli.layout import Layout
from longctx_cli.parallel import build_parallel_state, shard_batch
from longctx_cli.runtime.loss import valid_token_count
from longctx_cli.runtime.memory_savers import activation_offload, apply_tiled_mlp
from longctx_cli.runtime.model import build_model, decoder_and_head, model_config_of
from longctx_cli.train.objectives.causal_lm import forward_loss_sum

MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
WORLD = 4
OPTIONS = {  # option name -> config keys
    "plain": {},
    "chunked": {"chunked_loss": True},
    "tiled": {"tiled_mlp": True},
    "gc": {"gradient_checkpointing": True},
    "gc_offload": {"gradient_checkpointing": True, "activation_offloading": True},
    "all": {"gradient_checkpointing": True, "chunked_loss": True, "tiled_mlp": True},
}
STRATEGIES = {  # name -> (sp, mode, layout)
    "sp1": (1, "ring", "contiguous"),
    "sp2_contiguous": (2, "ring", "contiguous"),
    "sp2_zigzag": (2, "ring", "zigzag"),
    "sp2_ulysses": (2, "ulysses", "contiguous"),
    "sp4_zigzag": (4, "ring", "zigzag"),
    "sp4_batch_ring": (4, "ring", "contiguous"),
    "sp4_batch_zigzag": (4, "ring", "zigzag"),
}
RING_FUNC = {  # strategies on a P2P ring; the others use varlen_llama3
    "sp4_batch_ring": "batch_ring",
    "sp4_batch_zigzag": "batch_zigzag",
}
CONTEXTS: dict = {}


def context_key(strategy: str) -> tuple:
    return (*STRATEGIES[strategy], RING_FUNC.get(strategy, "varlen_llama3"))


@dataclass(frozen=True)
class Variant:
    strategy: str
    option: str
    tokens: int

    @property
    def sp(self) -> int:
        return STRATEGIES[self.strategy][0]

    @property
    def name(self) -> str:
        return f"{self.strategy}/{self.option}"


@dataclass
class Measured:
    times_s: list[float] = field(default_factory=list)
    peaks_mib: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)


def variant_config(v: Variant, loss_chunk_size: int = 1024) -> Config:
    sp, mode, layout = STRATEGIES[v.strategy]
    return config_from_dict({
        "model_config": MODEL,
        "dtype": "float32",
        "attention_kernel": "torch",
        "sequence_len": v.tokens,
        "sequence_parallel_degree": sp,
        "sequence_parallel_mode": mode,
        "sp_sharding": layout,
        "ring_attn_func": RING_FUNC.get(v.strategy, "varlen_llama3"),
        "loss_chunk_size": loss_chunk_size,
        "optimizer": "adamw",
        **OPTIONS[v.option],
    })


def predicted_mib(v: Variant) -> float:
    """What `longctx validate` estimates for this variant, per rank."""
    config = variant_config(v)
    shape = ModelShape.from_hf_config(model_config_of(config))
    sp = STRATEGIES[v.strategy][0]
    layout = layout_for(config, sp, None)
    estimate = estimate_memory(config, shape, sp, layout, host_is_device=True)[0]
    return estimate.total / 2**20


# ---- measuring a rank ------------------------------------------------------------------


def synthetic_row(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row of documents of 1/8 .. 1/2 of the row; labels -100 at document starts."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1, vocab, (tokens,), generator=g)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(tokens // 8, tokens // 2 + 1, (1,), generator=g)))
        lengths.append(n)
        left -= n
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[positions == 0] = -100
    return ids, positions, labels


def init_optimizer_state(params: list[torch.nn.Parameter], optimizer) -> None:
    """Create AdamW's moments before the measured step, so it sees the steady state (every
    step after the first holds the moments through forward and backward)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(v: Variant) -> tuple[float, float, float] | None:
    """Build, step once: (seconds, peak growth in bytes, CPU seconds of the compute thread)
    on active ranks, None on idle ones."""
    if dist.get_rank() >= v.sp:
        return None
    config = variant_config(v)
    ctx = CONTEXTS[context_key(v.strategy)]
    gc.collect()
    base = reset_peak()
    model = build_model(config)
    if config.memory.tiled_mlp:
        apply_tiled_mlp(model, config.memory.tiled_mlp_tiles)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    init_optimizer_state(params, optimizer)
    batch = shard_batch(*synthetic_row(v.tokens, MODEL["vocab_size"]), ctx, 0)
    count = torch.tensor([float(valid_token_count(batch.shift_labels))])
    if ctx.sp_group is not None:
        dist.all_reduce(count, group=ctx.sp_group)
    start, cpu_start = time.perf_counter(), time.thread_time()
    with activation_offload(config.memory.activation_offloading):
        loss = forward_loss_sum(decoder, head, batch, config, ctx)
        (loss / count).backward()
    if ctx.sp_group is not None:
        for p in params:
            dist.all_reduce(p.grad, group=ctx.sp_group)
    optimizer.step()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    grown = peak_bytes() - base
    del model, decoder, head, params, optimizer, batch, loss
    return elapsed, float(grown), cpu


def measure(v: Variant) -> tuple[float, float, float]:
    """(slowest active rank's seconds, largest peak growth in MiB, largest compute-thread
    CPU seconds). On a shared machine the CPU seconds show the work each rank does, which
    is what the step time would be with a core per rank (communication waits excluded)."""
    got = run_step(v) or (0.0, 0.0, 0.0)
    stats = torch.tensor(got, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), float(stats[1]) / 2**20, float(stats[2])


def build_contexts(strategies: list[str]) -> None:
    for s in strategies:  # new_group is collective: every rank builds every context
        sp, mode, layout, func = context_key(s)
        if (sp, mode, layout, func) not in CONTEXTS:
            CONTEXTS[(sp, mode, layout, func)] = build_parallel_state(Layout.filling(
                dist.get_world_size(), sp=sp, mode=mode, sharding=layout, kernel="torch",
                ring_attn_func=func))


def run_rounds(variants: list[Variant], repeats: int, log: bool) -> dict[Variant, Measured]:
    """Every variant once per round, the order rotated each round."""
    runs = {v: Measured() for v in variants}
    for r, v in rounds(variants, repeats, stride=3):
        t, mib, cpu = measure(v)
        runs[v].times_s.append(t)
        runs[v].peaks_mib.append(mib)
        runs[v].cpu_s.append(cpu)
        if log:
            print(f"  {v.tokens:>6} {v.name:<26} round {r}: {t:6.2f}s (cpu {cpu:6.2f}s) "
                  f"{mib:7.0f} MiB", flush=True)
    return runs


# ---- the benchmark ---------------------------------------------------------------------


def plan_variants(args: argparse.Namespace) -> list[tuple[list[Variant], int]]:
    """Groups of variants compared side by side (each group interleaved on its own)."""
    groups = []
    for tokens in args.tokens:
        strategies = [s for s in args.strategies if s != "sp4_zigzag"]
        groups.append(([Variant(s, "plain", tokens) for s in strategies], args.repeats))
    for tokens in args.option_tokens:
        options = [Variant(s, o, tokens) for s in ("sp1", "sp2_zigzag") for o in args.options]
        groups.append((options, args.option_repeats))
    for tokens in args.sp4_tokens:
        sp4 = [Variant(s, "plain", tokens) for s in ("sp1", "sp2_zigzag", "sp4_zigzag")]
        groups.append((sp4, args.option_repeats))
    return [g for g in groups if g[0]]


def init_rank(warmup_option: str) -> None:
    """One benchmark rank, in its gloo group: every strategy's context, a warm-up."""
    build_contexts(list(STRATEGIES))
    measure(Variant("sp2_zigzag", warmup_option, 512))  # one-off allocations and imports


def spawn_ranks(worker, args: argparse.Namespace):
    """`worker(rank, WORLD, args)` on WORLD ranks of one compute thread each; rank 0's value."""
    # Return freed large buffers to the OS at once, so the high-water mark is live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return run_ranks(worker, WORLD, args)[0]


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    init_rank("all")
    results = []
    for group, repeats in plan_variants(args):
        for v, m in run_rounds(group, repeats, rank == 0).items():
            results.append({
                "tokens": v.tokens, "strategy": v.strategy, "option": v.option, "sp": v.sp,
                "times_s": m.times_s, "median_s": statistics.median(m.times_s),
                "cpu_s": m.cpu_s, "median_cpu_s": statistics.median(m.cpu_s),
                "peak_mib": statistics.median(m.peaks_mib),
                "predicted_mib": predicted_mib(v),
            })
    return results


def table(results: list[dict]) -> str:
    by: dict = {}
    for r in results:  # the first group measuring a variant is its reference
        by.setdefault((r["tokens"], r["strategy"], r["option"]), r)
    rows = []
    for r in results:
        sp1 = by.get((r["tokens"], "sp1", "plain"))
        same = by.get((r["tokens"], r["strategy"], "plain"))
        t_ratio = f"{r['median_s'] / sp1['median_s']:.2f}x" if sp1 else "-"
        c_ratio = f"{r['median_cpu_s'] / sp1['median_cpu_s']:.2f}x" if sp1 else "-"
        m_ratio = f"{r['peak_mib'] / sp1['peak_mib']:.2f}x" if sp1 else "-"
        s_ratio = f"{r['peak_mib'] / same['peak_mib']:.2f}x" if same else "-"
        rows.append([r["tokens"], r["strategy"], r["option"], f"{r['median_s']:.2f}", t_ratio,
                     f"{r['median_cpu_s']:.2f}", c_ratio, f"{r['peak_mib']:.0f}", m_ratio,
                     s_ratio, f"{r['predicted_mib']:.0f}",
                     f"{r['predicted_mib'] / r['peak_mib']:.2f}"])
    return markdown_table(["tokens", "strategy", "option", "median step (s)", "vs sp1",
                           "max-rank CPU (s)", "vs sp1", "peak/rank (MiB)", "vs sp1",
                           "vs same sp plain", "validate (MiB)", "est/meas"], rows)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [f"{r['tokens'] // 1024}K {r['strategy']}/{r['option']}" for r in results]
    ax.barh(names, [r["peak_mib"] for r in results], label="measured")
    ax.scatter([r["predicted_mib"] for r in results], names, color="k", s=10, label="validate")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16384],
                        help="rows for the strategy timing (sp1 vs sp2)")
    parser.add_argument("--option-tokens", type=int, nargs="*", default=[8192],
                        help="rows for the memory options at sp1 and sp2 zigzag")
    parser.add_argument("--sp4-tokens", type=int, nargs="*", default=[8192])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES))
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--option-repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args()
    results = spawn_ranks(worker, args)
    write_results(args.out, {"model": MODEL, "threads_per_rank": 1, "world": WORLD,
                             "results": results})
    print(table(results))
    plot(results, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()

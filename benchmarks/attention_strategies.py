"""Forward+backward time and peak memory per rank of the SP attention strategies (CPU, gloo).

    python benchmarks/attention_strategies.py                    # sp=2 at 8K and 16K, sp=4 at 4K
    python benchmarks/attention_strategies.py --sp2-tokens 4096 --sp4-tokens 2048 --repeats 3

One causal document per row, fp32, ``--heads`` query/KV heads of ``--dim``, one thread per
rank. Variants are interleaved (every repeat runs each variant once, in a rotated order) and
the median is reported, because timings of several processes on a small machine drift.

* ``sdpa_1proc``: single-process ``scaled_dot_product_attention(is_causal=True)`` on the full
  row (rank 0 only, the other ranks wait), the reference for speed-ups;
* ``ring_contiguous`` / ``ring_zigzag`` / ``ulysses`` / ``ulysses_zigzag`` / ``hybrid_*``:
  :func:`longctx_cli.parallel.sp_attention` with that mode and layout;
* ``a2a_sdpa_peer``: the usual Ulysses implementation (all-to-all, then plain causal SDPA on
  the whole row, all-to-all back), the peer to beat.

Time is the slowest rank's wall time of one forward+backward. Memory is the rise of the
resident set's high-water mark during that step above the resident set just before it
(inputs already allocated), max over ranks; glibc is told to return large blocks to the OS
at once so that the resident set follows live tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import RESULTS, markdown_table, peak_bytes, reset_peak, rounds, run_ranks, write_results

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _measure(step: Callable[[], None]) -> tuple[float, float]:
    """(seconds, peak MiB above the resident set at the start) of one call."""
    before = reset_peak()
    start = time.perf_counter()
    step()
    elapsed = time.perf_counter() - start
    return elapsed, (peak_bytes() - before) / 2**20


def _slowest(step: Callable[[], None]) -> tuple[float, float]:
    """`_measure` of one call on every rank, started together: the largest of each over ranks."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    stats = torch.tensor(_measure(step), dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), float(stats[1])


def _contexts(world: int, ulysses_degree: int) -> dict[str, Any]:
    """Every SP context the variants need; groups are created once, in the same order on all."""
    from longctx_cli.layout import Layout
    from longctx_cli.parallel import build_parallel_state

    ring = build_parallel_state(Layout(sp=world, mode="ring", kernel="torch"))
    ctxs = {
        "ring_contiguous": ring,
        "ring_zigzag": ring.with_layout(sharding="zigzag"),
        "ulysses": ring.with_layout(mode="ulysses", ulysses=world),
        "ulysses_zigzag": ring.with_layout(mode="ulysses", ulysses=world, sharding="zigzag"),
    }
    if world > 2 and world % ulysses_degree == 0:
        hyb = build_parallel_state(Layout(sp=world, mode="hybrid", ulysses=ulysses_degree,
                                          kernel="torch"))
        u, r = ulysses_degree, world // ulysses_degree
        ctxs[f"hybrid_{u}x{r}_contiguous"] = hyb
        ctxs[f"hybrid_{u}x{r}_zigzag"] = hyb.with_layout(sharding="zigzag")
    return ctxs


def _sp_step(ctx: Any, tokens: int, heads: int, dim: int) -> Callable[[], None]:
    import torch

    from longctx_cli.parallel import make_sp_meta, sp_attention

    local = tokens // ctx.layout.sp
    g = torch.Generator().manual_seed(ctx.sp_rank)
    q, k, v, dout = (torch.randn(local, heads, dim, generator=g) for _ in range(4))

    def step() -> None:
        meta = make_sp_meta(torch.arange(tokens), ctx)  # per row, as the trainer does
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sp_attention(*leaves, meta, dim**-0.5).backward(dout)

    return step


def _peer_step(ctx: Any, tokens: int, heads: int, dim: int) -> Callable[[], None]:
    """All-to-all + causal SDPA on the whole row, through our exchange (contiguous layout)."""
    import torch
    import torch.nn.functional as F

    from longctx_cli.parallel import make_sp_meta
    from longctx_cli.parallel.ulysses import build_exchange, heads_to_seq, seq_to_heads

    local = tokens // ctx.layout.sp
    g = torch.Generator().manual_seed(ctx.sp_rank)
    q, k, v, dout = (torch.randn(local, heads, dim, generator=g) for _ in range(4))

    def step() -> None:
        ex = build_exchange(make_sp_meta(torch.arange(tokens), ctx), ctx.sp_group, ctx.layout.sp)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        qh, kh, vh = (seq_to_heads(x, ex).transpose(0, 1).unsqueeze(0) for x in leaves)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        heads_to_seq(out[0].transpose(0, 1), ex).backward(dout)

    return step


def _sdpa_step(rank: int, tokens: int, heads: int, dim: int) -> Callable[[], None]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, tokens, dim, generator=g) for _ in range(4))

    def step() -> None:
        if rank != 0:
            return
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)

    return step


def _variants(rank: int, world: int, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    ctxs = _contexts(world, args.ulysses_degree)
    steps = {"sdpa_1proc": _sdpa_step(rank, tokens, args.heads, args.dim)}
    steps.update({n: _sp_step(c, tokens, args.heads, args.dim) for n, c in ctxs.items()})
    steps["a2a_sdpa_peer"] = _peer_step(ctxs["ulysses"], tokens, args.heads, args.dim)
    return steps


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    rows = []
    for tokens in args.tokens_for[world]:
        steps = _variants(rank, world, tokens, args)
        names = list(steps)
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for n in names:  # warm-up: first-call allocations and group set-up
            dist.barrier()
            steps[n]()
        for _, n in rounds(names, args.repeats):
            samples[n].append(_slowest(steps[n]))
        rows += [_summary(world, tokens, n, s) for n, s in samples.items()]
    return rows


def _summary(world: int, tokens: int, name: str, samples: list[tuple[float, float]]) -> dict:
    secs = [s for s, _ in samples]
    return {
        "sp": world,
        "tokens": tokens,
        "variant": name,
        "median_s": statistics.median(secs),
        "min_s": min(secs),
        "max_s": max(secs),
        "peak_mib_per_rank": statistics.median(m for _, m in samples),
        "repeats": len(samples),
    }


def run(world: int, args: argparse.Namespace) -> list[dict]:
    """One gloo job of ``world`` single-threaded processes; returns rank 0's rows."""
    os.environ.update(_MALLOC_ENV)  # read by glibc as the ranks start (common.run_ranks)
    return run_ranks(_worker, world, args, timeout_s=args.timeout_s)[0]


def add_speedups(rows: list[dict]) -> None:
    base = {(r["sp"], r["tokens"]): r["median_s"] for r in rows if r["variant"] == "sdpa_1proc"}
    for r in rows:
        r["speedup_vs_sdpa"] = base[(r["sp"], r["tokens"])] / r["median_s"]


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["sp", "tokens", "variant", "median s", "min-max s", "speed-up vs SDPA", "peak MiB/rank"],
        ([r["sp"], r["tokens"], r["variant"], f"{r['median_s']:.3f}",
          f"{r['min_s']:.3f}-{r['max_s']:.3f}", f"{r['speedup_vs_sdpa']:.2f}x",
          f"{r['peak_mib_per_rank']:.0f}"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp2-tokens", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--sp4-tokens", type=int, nargs="*", default=[4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_strategies.json")
    args = parser.parse_args()
    args.tokens_for = {2: args.sp2_tokens, 4: args.sp4_tokens}
    rows = [row for world in (2, 4) if args.tokens_for[world] for row in run(world, args)]
    add_speedups(rows)
    print(table(rows))
    meta = {
        "heads": args.heads,
        "dim": args.dim,
        "repeats": args.repeats,
        "ulysses_degree": args.ulysses_degree,
        "cpu_count": os.cpu_count(),
    }
    write_results(args.out, {"config": meta, "rows": rows})
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

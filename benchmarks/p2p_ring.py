"""P2P rings (batch_ring / batch_zigzag / batch_stripe) vs the llama3 all-gather ring, sp=4.

    nice python benchmarks/p2p_ring.py --tokens 65536 --heads 1 --dim 32 --repeats 2

Attention forward+backward on one causal document per row, fp32, four gloo processes with
one thread each. Per variant: the slowest rank's wall time (median over rotated rounds) and
the largest rise of a rank's resident set (VmHWM, reset before the step) above the resident
set before it - the memory the strategy needs on top of its inputs.

``p2p_compute_only`` runs exactly the pieces ``batch_zigzag`` computes, step by step, on the
rank's own K/V instead of the received block: the compute without any communication. The
ratio ``batch_zigzag / p2p_compute_only`` is what the transfers cost on top of compute (1.0 =
fully hidden behind compute).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import RESULTS, markdown_table, rounds, write_results

from benchmarks.attention_strategies import _MALLOC_ENV, _slowest
from benchmarks.train_step import spawn_ranks

RINGS = {  # variant -> (ring_attn_func, layout)
    "varlen_llama3": ("varlen_llama3", "contiguous"),
    "varlen_llama3_zigzag": ("varlen_llama3", "zigzag"),
    "batch_ring": ("batch_ring", "contiguous"),
    "batch_zigzag": ("batch_zigzag", "zigzag"),
    "batch_stripe": ("batch_stripe", "stripe"),
}


def _inputs(ctx: Any, tokens: int, heads: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(ctx.sp_rank)
    return [torch.randn(tokens // ctx.layout.sp, heads, dim, generator=g) for _ in range(4)]


def _sp_step(ctx: Any, tokens: int, heads: int, dim: int) -> Callable[[], None]:
    from longctx_cli.parallel import make_sp_meta, sp_attention

    q, k, v, dout = _inputs(ctx, tokens, heads, dim)

    def step() -> None:
        meta = make_sp_meta(torch.arange(tokens), ctx)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sp_attention(*leaves, meta, dim**-0.5).backward(dout)

    return step


def _compute_only_step(ctx: Any, tokens: int, heads: int, dim: int) -> Callable[[], None]:
    """The P2P ring's per-step kernels on the rank's own K/V: no transfer at all."""
    from longctx_cli.parallel import AttentionFeatures, make_sp_meta
    from longctx_cli.parallel.ring_p2p import step_geometry
    from longctx_cli.parallel.torch_kernel import pieces_backward, pieces_forward

    q, k, v, dout = _inputs(ctx, tokens, heads, dim)
    feats = AttentionFeatures(scale=dim**-0.5)

    def step() -> None:
        meta = make_sp_meta(torch.arange(tokens), ctx)
        geometry = [step_geometry(meta, s, feats) for s in range(ctx.layout.sp)]
        out = torch.zeros(q.shape)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for pieces, f in geometry:
            if pieces:
                pieces_forward(q, k, v, pieces, f, out, lse)
        dq = torch.zeros(q.shape)
        for pieces, f in geometry:
            if pieces:
                pieces_backward(dout, q, k, v, out, lse, pieces, f,
                                (dq, torch.zeros_like(k), torch.zeros_like(v)))

    return step


def _steps(args: argparse.Namespace, tokens: int) -> dict[str, Callable[[], None]]:
    from longctx_cli.layout import Layout
    from longctx_cli.parallel import build_parallel_state

    steps = {}
    for name, (func, layout) in RINGS.items():
        if name not in args.variants:
            continue
        ctx = build_parallel_state(Layout(sp=4, sharding=layout, ring_attn_func=func,
                                          kernel="torch"))
        steps[name] = _sp_step(ctx, tokens, args.heads, args.dim)
        if name == "batch_zigzag":
            single = dataclasses.replace(ctx, sp_group=None)  # geometry only, no ring
            steps["p2p_compute_only"] = _compute_only_step(single, tokens, args.heads, args.dim)
    return steps


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        steps = _steps(args, tokens)
        warm = _steps(args, 4096)
        for name in warm:  # first-call allocations and imports, on a short row
            dist.barrier()
            warm[name]()
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in steps}
        names = list(steps)
        for rep, name in rounds(names, args.repeats):
            seconds, mib = _slowest(steps[name])
            samples[name].append((seconds, mib))
            if rank == 0:
                print(f"  {tokens} {name:<22} round {rep}: {seconds:7.2f}s {mib:7.1f} MiB",
                      flush=True)
        for name, s in samples.items():
            rows.append({
                "tokens": tokens, "variant": name, "times_s": [t for t, _ in s],
                "median_s": statistics.median(t for t, _ in s),
                "peak_mib_per_rank": statistics.median(m for _, m in s),
            })
    return rows


def add_ratios(rows: list[dict]) -> None:
    by = {(r["tokens"], r["variant"]): r for r in rows}
    for r in rows:
        base = by.get((r["tokens"], "varlen_llama3"))
        compute = by.get((r["tokens"], "p2p_compute_only"))
        r["time_vs_llama3"] = r["median_s"] / base["median_s"] if base else None
        r["llama3_peak_over_this"] = (
            base["peak_mib_per_rank"] / r["peak_mib_per_rank"] if base else None
        )
        r["time_vs_compute_only"] = r["median_s"] / compute["median_s"] if compute else None


def table(rows: list[dict]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return markdown_table(
        ["tokens", "variant", "median s", "vs llama3", "vs compute only", "peak MiB/rank",
         "llama3 peak / this"],
        ([r["tokens"], r["variant"], f"{r['median_s']:.2f}", f"{f(r['time_vs_llama3'], '.2f')}x",
          f"{f(r['time_vs_compute_only'], '.2f')}x", f"{r['peak_mib_per_rank']:.0f}",
          f"{f(r['llama3_peak_over_this'], '.2f')}x"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(RINGS))
    parser.add_argument("--load-note", default="", help="how loaded the machine was")
    parser.add_argument("--out", default=str(RESULTS / "p2p_ring.json"))
    args = parser.parse_args()
    os.environ.update(_MALLOC_ENV)  # read by glibc as the ranks start (common.run_ranks)
    rows = spawn_ranks(worker, args)
    add_ratios(rows)
    write_results(args.out, {"sp": 4, "heads": args.heads, "dim": args.dim, "dtype": "float32",
                             "threads_per_rank": 1, "cpu_count": os.cpu_count(),
                             "load_note": args.load_note, "rows": rows})
    print(table(rows))
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

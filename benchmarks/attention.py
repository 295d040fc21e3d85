"""Causal attention forward+backward on CPU: our torch ring kernel at sp=1 and sp=2 vs SDPA.

    python benchmarks/attention.py --tokens 8192 16384 --repeats 3

Two gloo processes with one compute thread each are started once. In every round each
variant runs once, in a rotated order (the machine's load drifts, so variants are
interleaved rather than run back to back); single-process variants run on rank 0 while
rank 1 waits in a barrier. Reported times are medians over rounds of the slowest rank's
wall and CPU time. After all timings, one untimed step per variant measures memory: the
peak resident-set growth of a rank during the step (sampled from /proc every 2 ms), above
the level with its inputs allocated.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import markdown_table, rounds, rss_bytes, run_ranks, write_results

from longctx_cli.layout import Layout
from longctx_cli.parallel import (
    ParallelState,
    build_parallel_state,
    make_sp_meta,
    slice_sequence,
    sp_attention,
)

HEADS, DIM = 8, 64
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
CONTEXTS: dict = {}  # (sp, layout) -> ParallelState, built once per process
VARIANTS = ["sdpa", "torch_sp1", "torch_sp2_contiguous", "torch_sp2_zigzag"]


class PeakRSS:
    """Samples this process's resident set size in a background thread."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def full_inputs(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return [torch.randn(tokens, HEADS, DIM, generator=g) for _ in range(4)]  # q, k, v, dout


def prepare(variant: str, tokens: int) -> Callable[[], None] | None:
    """Build inputs for one variant on this rank; returns the step, or None if idle here."""
    rank = dist.get_rank()
    q, k, v, dout = full_inputs(tokens)
    if variant == "sdpa":
        if rank != 0:
            return None
        q, k, v, dout = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, dout))
        leaves = [x.requires_grad_() for x in (q, k, v)]
        return lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
    sp = 1 if variant == "torch_sp1" else 2
    if sp == 1 and rank != 0:
        return None
    layout = "zigzag" if variant.endswith("zigzag") else "contiguous"
    ctx = CONTEXTS[(sp, layout)]
    meta = make_sp_meta(torch.arange(tokens), ctx)
    leaves = [slice_sequence(x, ctx).contiguous().requires_grad_() for x in (q, k, v)]
    local_dout = slice_sequence(dout, ctx).contiguous()
    return lambda: sp_attention(*leaves, meta, DIM**-0.5).backward(local_dout)


def timed(variant: str, tokens: int) -> tuple[float, float]:
    """One fwd+bwd step: (wall seconds, CPU seconds) of the slowest rank.

    CPU time is what the step costs when the machine is shared with other work (wall time
    then also measures the other tenants)."""
    step = prepare(variant, tokens)
    dist.barrier()
    wall = cpu = 0.0
    if step is not None:
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
    return float(stats[0]), float(stats[1])


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def peak_memory(variant: str, tokens: int) -> float:
    """Largest RSS growth (MiB) of a rank during one untimed step, inputs already allocated.

    glibc is told to serve large blocks with mmap and to return free heap memory first, so
    resident memory follows live tensors rather than the allocator's cache."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    step = prepare(variant, tokens)
    if libc is not None:
        libc.malloc_trim(0)
    dist.barrier()
    grown = 0
    if step is not None:
        with PeakRSS() as mem:
            step()
        grown = mem.peak - mem.base
    peak = torch.tensor([float(grown)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak) / 2**20


def run_variants(args: argparse.Namespace) -> list[dict]:
    rank = dist.get_rank()
    for variant in args.variants:  # warm-up: first calls pay one-off setup costs
        timed(variant, 1024)
    results = []
    for tokens in args.tokens:
        repeats = args.repeats if tokens < args.long_from else args.repeats_long
        variants = list(args.variants)
        runs: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for r, variant in rounds(variants, repeats):
            runs[variant].append(timed(variant, tokens))
            if rank == 0:
                wall, cpu = runs[variant][-1]
                print(f"  {tokens:>6} {variant:<22} round {r}: {wall:.2f}s wall, {cpu:.2f}s cpu",
                      flush=True)
        results += [summary(tokens, v, runs[v]) for v in variants]
    if args.memory:  # after all timings: the allocator settings below slow allocation down
        for res in results:
            res["peak_mib"] = peak_memory(res["variant"], res["tokens"])
    return results


def summary(tokens: int, variant: str, runs: list[tuple[float, float]]) -> dict:
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    return {
        "tokens": tokens,
        "variant": variant,
        "wall_s": walls,
        "cpu_s": cpus,
        "median_wall_s": statistics.median(walls),
        "median_cpu_s": statistics.median(cpus),
        "peak_mib": None,
    }


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """One rank (one compute thread, as on the 2-core reference machine): every variant."""
    CONTEXTS[(1, "contiguous")] = ParallelState()
    for layout in ("contiguous", "zigzag"):
        CONTEXTS[(2, layout)] = build_parallel_state(Layout(
            sp=2, sharding=layout, heads_k_stride=args.heads_k_stride, kernel="torch"))
    return run_variants(args)


def table(results: list[dict]) -> str:
    """Markdown table: medians of wall and CPU time, ratios to sp=1 and SDPA, peak memory."""
    by = {(r["tokens"], r["variant"]): r for r in results}
    rows = []
    for r in results:
        t, v = r["tokens"], r["variant"]
        wall, cpu = r["median_wall_s"], r["median_cpu_s"]
        ranks = 2 if "sp2" in v else 1
        sp1, sdpa = by.get((t, "torch_sp1")), by.get((t, "sdpa"))
        w1 = f"{wall / sp1['median_wall_s']:.2f}x" if sp1 else "-"
        c1 = f"{cpu / sp1['median_cpu_s']:.2f}x" if sp1 else "-"
        cs = f"{cpu * ranks / sdpa['median_cpu_s']:.2f}x" if sdpa else "-"
        mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        rows.append([t, v, f"{wall:.2f}", f"{cpu:.2f}", w1, c1, cs, mem, len(r["wall_s"])])
    return markdown_table(["tokens", "variant", "wall (s)", "CPU (s)", "wall vs sp=1",
                           "CPU vs sp=1", "rank-CPU-s / SDPA", "peak RSS growth / rank (MiB)",
                           "runs"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-from", type=int, default=32768, help="fewer repeats from here")
    parser.add_argument("--repeats-long", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--heads-k-stride", type=int, default=1)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--out", default="benchmarks/results/attention.json")
    args = parser.parse_args()
    results = run_ranks(worker, 2, args)[0]
    write_results(args.out, {"heads": HEADS, "dim": DIM, "threads_per_rank": 1,
                             "results": results})
    print(table(results))


if __name__ == "__main__":
    main()

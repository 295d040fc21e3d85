"""Reach: how much memory a token costs per rank, longctx against DeepSpeed ALST, each with
its full memory recipe, and the longest row that fits a per-rank budget.

    python benchmarks/reach.py                        # 8K, 16K, 32K at sp 2
    python benchmarks/reach.py --lengths 8192 16384 --malloc-mmap-threshold 1048576
    python benchmarks/reach.py --table benchmarks/results/reach-2026-11-26.json

The model is `peers.py`'s Llama (hidden 256, 4 layers, 8 heads, vocab 32,000, 20.6M
parameters), small enough that activations, not weights, grow with the row. Each length is
one row of tokens (prepared by longctx and handed to ALST, `peers.prepare_workload`), trained
from the same initial weights at sp 2 for `--steps` steps (full fine-tuning, float32, AdamW;
the second step is the first with AdamW's state alive, so its peak is the steady one), each
tool with every memory feature it has:

- longctx (`longctx train`, ring and Ulysses): `gradient_checkpointing: true`, `tiled_mlp:
  true` (tiles of ~hidden_size tokens), the fused loss (on by default for a plain head:
  logits in blocks of 64 MiB, never `[tokens, vocab]`); the ring is llama3's all-gather with
  `heads_k_stride: 1` (one KV head's K,V gathered at a time, `sp_sharding: zigzag`) rather
  than the default P2P stripe ring, which holds whole K,V blocks in flight.
  `host_mmap_threshold_mib: 1` (glibc's mmap threshold fixed in each rank, so freed
  activations are given back rather than kept as heap fragments; `docs/memory.md`).
  `activation_offloading` is off: it moves saved activations from the accelerator to host
  memory, and on a CPU they are already there (longctx keeps CPU tensors where they are), so
  it changes nothing here.
- DeepSpeed ALST (`peer_worker.py --tool alst`, ZeRO 0), switched on as ArcticTraining
  does: `TiledMLP` patched into `LlamaMLP.forward` before the model is built (shards
  ceil(tokens / hidden_size)), transformers' activation checkpointing of every layer, and
  the loss through `TiledFusedLogitsLoss`. ArcticTraining sizes the loss shards to ~1 GiB of
  float32 logits each (`--alst-loss-shards auto`); by default here each shard holds at most
  longctx's 64 MiB logits block instead, the same tile, which costs ALST less memory than
  its own default. DeepSpeed's activation-checkpoint offload is, like longctx's, a device to
  host copy, and is left off for the same reason. ALST runs twice: as it comes, and with
  glibc's threshold fixed as longctx's recipe fixes it (`MALLOC_MMAP_THRESHOLD_`), so that
  the two tools' live memory is compared under the same allocator.
- plain HF (one process, the whole row) with its one memory feature, gradient checkpointing:
  the yardstick.

Peak memory is each rank process's resident-set high-water mark (VmHWM) over the whole run,
read from /proc while it runs (`peers.run_watched`); the larger of the two ranks counts.
Memory does not depend on machine load, so one run per length is the default (`--runs`).
Per tool, a least-squares line through (tokens per rank, peak) gives the fixed part (the
intercept: weights, gradients, AdamW state, the runtime) and the bytes per token per rank
(the slope); the longest row under `--budget-gib` per rank is where that line meets the
budget, rounded down to 1,024 tokens; `--verify` trains that row once per tool and reports
its measured peak. Every tool's losses at every step must agree (same weights, same tokens,
exact methods), so the memory is measured on the same work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from common import ROOT, markdown_table, save_record

from benchmarks import peers
from longctx_cli.constants import FUSED_LOSS_BLOCK_BYTES
from longctx_cli.launcher.host_memory import THRESHOLD_ENV

# `alst-zero0` as it runs, and with glibc's mmap threshold fixed where longctx's recipe fixes
# its own: the same allocator for both, to compare what they keep alive.
TOOLS = ("longctx-ring", "longctx-ulysses", "longctx-ulysses-chunked", "alst-zero0",
         peers.ALST_AT_LONGCTX_THRESHOLD, "hf")
# `longctx-ulysses` with the heads attended a chunk at a time: the most chunks the 8 heads
# allow at sp 2 (`ulysses_head_chunks`; the plan's own pick is 1 at these lengths).
HEAD_CHUNKS = 4
# longctx's host allocator setting (`host_mmap_threshold_mib`), and ALST's second run's.
THRESHOLD_MIB = 1
LONGCTX_MEMORY = {"gradient_checkpointing": True, "tiled_mlp": True,
                  "activation_offloading": False, "host_mmap_threshold_mib": THRESHOLD_MIB}
# The ring that holds least: llama3's all-gather one KV head at a time (the default ring,
# batch_stripe, passes whole K,V blocks and their gradients around, two of each in flight).
RING_MEMORY = {"ring_attn_func": "varlen_llama3", "sp_sharding": "zigzag", "heads_k_stride": 1}
MiB = 2**20


def row_name(tokens: int) -> str:
    name = f"reach-{tokens // 1024}k" if tokens % 1024 == 0 else f"reach-{tokens}"
    peers.ROWS[name] = (peers.LLAMA, tokens)  # prepare_workload reads the row from here
    return name


def alst_flags(tokens: int, loss_shards: str | None) -> tuple[str, ...]:
    """ALST's memory recipe as peer_worker.py flags; loss shards of at most longctx's fused
    block of float32 logits unless `loss_shards` names ArcticTraining's `auto` or a count."""
    if loss_shards is None:
        per_rank = tokens // peers.SP
        loss_shards = str(math.ceil(per_rank * peers.LLAMA["vocab_size"] * 4
                                    / FUSED_LOSS_BLOCK_BYTES))
    return ("--tiled-mlp", "--checkpointing", "--loss-shards", loss_shards)


@contextmanager
def allocator_threshold(threshold: int | None) -> Iterator[None]:
    """Processes started inside run with glibc's mmap threshold fixed at `threshold` bytes."""
    if threshold is None:
        yield
        return
    before = os.environ.get(THRESHOLD_ENV)
    os.environ[THRESHOLD_ENV] = str(threshold)
    try:
        yield
    finally:
        os.environ.pop(THRESHOLD_ENV)
        if before is not None:
            os.environ[THRESHOLD_ENV] = before


def worker_flags(tool: str, tokens: int, loss_shards: str | None) -> tuple[str, ...]:
    """peer_worker.py's memory recipe of `tool`: ALST's, or plain HF's only memory feature,
    transformers' activation checkpointing."""
    if tool == "hf":
        return ("--checkpointing",)
    return alst_flags(tokens, loss_shards) if tool.startswith("alst") else ()


def ranks_of(tool: str) -> int:
    """Plain HF is one process holding the whole row; the others split it over sp ranks."""
    return 1 if tool == "hf" else peers.SP


def with_memory_recipe(configs: dict[str, Path]) -> None:
    """longctx's configs of a row, rewritten with every memory feature on (module doc)."""
    for tool, path in configs.items():
        ring = RING_MEMORY if tool == "longctx-ring" else {}
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **LONGCTX_MEMORY,
                                        **ring}))
    ulysses = yaml.safe_load(configs["longctx-ulysses"].read_text())
    chunked = configs["longctx-ulysses"].with_name("longctx-ulysses-chunked.yaml")
    chunked.write_text(yaml.safe_dump({**ulysses, "ulysses_head_chunks": HEAD_CHUNKS,
                                       "output_dir": ulysses["output_dir"] + "-chunked"}))
    configs["longctx-ulysses-chunked"] = chunked


def run_length(tokens: int, tools: list[str], work: Path, steps: int, runs: int,
               peer_python: Path | None, loss_shards: str | None) -> dict[str, list[dict]]:
    name = row_name(tokens)
    row_work = work / name
    model_dir, configs = peers.prepare_workload(name, row_work, steps)
    with_memory_recipe(configs)
    out: dict[str, list[dict]] = {tool: [] for tool in tools}
    for run in range(runs):
        order = tools[run % len(tools):] + tools[:run % len(tools)]
        for tool in order:
            base = "alst-zero0" if tool == peers.ALST_AT_LONGCTX_THRESHOLD else tool
            with allocator_threshold(THRESHOLD_MIB << 20 if base != tool else None):
                r = peers.run_tool(base, name, row_work, model_dir, configs, steps, run,
                                   peer_python, worker_flags(base, tokens, loss_shards))
            out[tool].append(r)
            print(f"{tokens:,} tokens run {run + 1}/{runs} {tool}: peak per rank "
                  f"{' / '.join(f'{p:,.0f}' for p in r['peak_mib'])} MiB, "
                  f"{max(r['seconds']):.1f} s/step max, losses "
                  f"{', '.join(f'{x:.5f}' for x in r['losses'])}", flush=True)
    return out


def check_losses(tokens: int, by_tool: dict[str, list[dict]]) -> None:
    """Same weights, same tokens, exact methods: every step's loss agrees across tools."""
    ref_tool = next(iter(by_tool))
    ref = by_tool[ref_tool][0]["losses"]
    for tool, rs in by_tool.items():
        for r in rs:
            for i, (a, b) in enumerate(zip(r["losses"], ref, strict=True)):
                if abs(a - b) > 1e-4 * abs(b) + 1e-5:
                    raise SystemExit(f"{tokens:,} tokens: {tool}'s step {i + 1} loss {a:.6f} "
                                     f"differs from {ref_tool}'s {b:.6f}")


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares peak_MiB = fixed + slope * tokens_per_rank: (fixed MiB, bytes per token,
    the largest distance of a point from the line in MiB)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    fixed = my - slope * mx
    worst = max(abs(y - fixed - slope * x) for x, y in points)
    return fixed, slope * MiB, worst


def longest_row(fixed_mib: float, bytes_per_token: float, budget_gib: float,
                ranks: int = peers.SP) -> int:
    """The longest row (tokens over all `ranks`, a multiple of 1,024) the line fits."""
    per_rank = (budget_gib * 1024 - fixed_mib) * MiB / bytes_per_token
    return max(0, int(per_rank * ranks) // 1024 * 1024)


def summarize(raw: dict[int, dict[str, list[dict]]], budget_gib: float) -> dict[str, dict]:
    tools = list(next(iter(raw.values())))
    out = {}
    for tool in tools:
        peaks = {tokens: max(p for r in by_tool[tool] for p in r["peak_mib"])
                 for tokens, by_tool in raw.items()}
        fixed, per_token, worst = fit([(t // ranks_of(tool), p) for t, p in peaks.items()])
        out[tool] = {"peak_mib": {str(t): round(p, 1) for t, p in peaks.items()},
                     "s_per_step_max": {str(t): round(max(s for r in by_tool[tool]
                                                          for s in r["seconds"]), 2)
                                        for t, by_tool in raw.items()},
                     "fixed_mib": round(fixed, 1), "bytes_per_token_per_rank": round(per_token),
                     "fit_worst_mib": round(worst, 1),
                     "longest_row": longest_row(fixed, per_token, budget_gib,
                                                 ranks_of(tool))}
    return out


def table(summary: dict[str, dict], budget_gib: float, verified: dict | None = None) -> str:
    lengths = list(next(iter(summary.values()))["peak_mib"])
    alst = next((s for t, s in summary.items() if t.startswith("alst")), None)
    at = " / ".join(f"{int(t) // 1024}K" for t in lengths)
    rows = []
    for tool, s in summary.items():
        ratio = (f"{s['bytes_per_token_per_rank'] / alst['bytes_per_token_per_rank']:.2f}x"
                 if alst else "-")
        longest = f"{s['longest_row']:,}"
        if verified and tool in verified:
            v = verified[tool]
            longest += f" (ran: {v['peak_mib']:,.0f} MiB)"
        rows.append([tool, " / ".join(f"{p:,.0f}" for p in s["peak_mib"].values()),
                     f"{s['fixed_mib']:,.0f}", f"{s['bytes_per_token_per_rank']:,}", ratio,
                     longest])
    return markdown_table(["tool", f"peak RSS per rank (MiB) at {at}", "fixed part (MiB)",
                           "bytes per token per rank", "vs ALST",
                           f"longest row in {budget_gib:g} GiB per rank"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768],
                   help="row lengths in tokens (over both SP ranks)")
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    p.add_argument("--runs", type=int, default=1, help="alternated runs per tool and length")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-gib", type=float, default=2.0, help="memory per rank")
    p.add_argument("--alst-loss-shards", default=None,
                   help="ALST's loss shards per rank: `auto` (ArcticTraining's ~1 GiB of logits "
                   "per shard) or a count; default: shards of at most longctx's fused block")
    p.add_argument("--verify", action="store_true",
                   help="train each tool's predicted longest row once and report its peak")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None,
                   help="bytes: run every tool with glibc's MALLOC_MMAP_THRESHOLD_ fixed to this "
                   "(allocations above it are mmapped and returned on free), to tell memory "
                   "the allocator keeps from memory the tools keep alive")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "reach")
    p.add_argument("--stem", default="reach")
    p.add_argument("--table", type=Path, help="only print the table of a saved JSON")
    args = p.parse_args()
    if args.table:
        record = json.loads(args.table.read_text())
        print(table(record["summary"], record["budget_gib"], record.get("verified")))
        return
    assert len(args.lengths) >= 2 and args.steps >= 2 and args.runs >= 1

    if args.malloc_mmap_threshold is not None:  # the tools' processes inherit it
        os.environ[THRESHOLD_ENV] = str(args.malloc_mmap_threshold)
    peer_python = peers.ensure_peer_venv() if any(t.startswith("alst") for t in args.tools) \
        else None
    begun = time.time()
    raw: dict[int, dict[str, list[dict]]] = {}
    for tokens in args.lengths:
        raw[tokens] = run_length(tokens, args.tools, args.work, args.steps, args.runs,
                                 peer_python, args.alst_loss_shards)
        check_losses(tokens, raw[tokens])
    summary = summarize(raw, args.budget_gib)
    verified = None
    if args.verify:
        verified = {}
        for tool, s in summary.items():
            tokens = s["longest_row"]
            r = run_length(tokens, [tool], args.work, args.steps, 1, peer_python,
                           args.alst_loss_shards)[tool][0]
            verified[tool] = {"tokens": tokens, "peak_mib": max(r["peak_mib"]),
                              "losses": r["losses"]}
    print(table(summary, args.budget_gib, verified))
    save_record(args.stem, {
        "command": " ".join(["python", "benchmarks/reach.py", *sys.argv[1:]]),
        "sp": peers.SP, "threads_per_rank": 1, "steps": args.steps, "runs": args.runs,
        "budget_gib": args.budget_gib, "deepspeed": peers.DEEPSPEED, "model": peers.LLAMA,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "longctx_memory": LONGCTX_MEMORY,
        "alst_flags": {str(t): list(alst_flags(t, args.alst_loss_shards)) for t in args.lengths},
        "summary": summary, "verified": verified,
        "raw": {str(t): v for t, v in raw.items()}, "total_s": round(time.time() - begun),
    })


if __name__ == "__main__":
    main()

"""The few lines `longctx train` prints when it is done: time, throughput, peak memory per
rank and where the outputs are. Kept out of the loop so the loop stays one readable file."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1024**2


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA memory allocated by torch, else the peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def gather_peak_memory(device: torch.device) -> list[int]:
    """Every rank's peak memory in bytes (a collective: every rank calls it)."""
    peaks = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    peaks[dist.get_rank()] = float(peak_memory_bytes(device))
    dist.all_reduce(peaks)
    return [int(p) for p in peaks.tolist()]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def summary_lines(
    seconds: float,
    steps: int,
    tokens: int,
    peaks: list[int],
    device: torch.device,
    output_dir: Path,
    final: Path,
) -> list[str]:
    """Human-readable end-of-run summary (rank 0 prints it)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    kind = "CUDA allocated" if device.type == "cuda" else "resident set"
    per_rank = ", ".join(f"rank {r} {p / MIB:,.0f} MiB" for r, p in enumerate(peaks))
    checkpoints = sorted((p.name for p in output_dir.glob("checkpoint-*") if p.is_dir()),
                         key=lambda name: (len(name), name))  # checkpoint-500 before -1000
    samples = ["completions.jsonl"] if (output_dir / "completions.jsonl").is_file() else []
    outputs = ["metrics.jsonl", *samples, *(f"{c}/" for c in checkpoints), f"{final.name}/"]
    return [
        f"done: {steps:,} steps in {_duration(seconds)}, {tokens:,} target tokens, "
        f"{rate:,.0f} tokens/s",
        f"peak memory per rank ({kind}): {per_rank}",
        f"outputs in {output_dir}/: " + ", ".join(outputs),
        f"final model (Hugging Face format): {final}",
    ]

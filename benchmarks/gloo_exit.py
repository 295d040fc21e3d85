"""How often a gloo job aborts at exit when its process group is still alive.

Each run starts 4 processes (`torch.multiprocessing`, spawn) that join a gloo group,
all-gather one tensor and return, either leaving the group alive (torn down during
interpreter finalization) or destroying it first (what `runtime/distributed.py:
process_group_released` does on every longctx rank). A run counts as an abort when it printed
"terminate called without an active exception" or a process died of SIGABRT. Prints a table
and writes JSON. Its processes are its own, not `common.run_ranks`'s: those always destroy
their group.

    python benchmarks/gloo_exit.py --runs 16
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

from common import RESULTS, markdown_table, save_record

WORLD = 4
ABORT_WORDS = ("terminate called", "SIGABRT", "signal 6")


def _worker(rank: int, port: int, destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out = [torch.empty(1) for _ in range(WORLD)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    if destroy:
        dist.barrier()
        dist.destroy_process_group()


def _job(port: int, destroy: bool) -> None:
    """One job: WORLD spawned workers (the parent raises if one dies)."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(port, destroy), nprocs=WORLD, start_method="spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(destroy: bool) -> bool:
    """Whether this run aborted at exit."""
    job = subprocess.run([sys.executable, __file__, "--job", str(_free_port()),
                          "destroy" if destroy else "keep"],
                         capture_output=True, text=True, timeout=300)
    out = job.stdout + job.stderr
    return any(w in out for w in ABORT_WORDS)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        _job(int(sys.argv[2]), sys.argv[3] == "destroy")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "gloo_exit.json")
    args = parser.parse_args()
    import torch

    results = {}
    for destroy in (False, True):
        aborts = sum(one_run(destroy) for _ in range(args.runs))
        results["destroyed" if destroy else "left alive"] = aborts
    print(markdown_table(["process group at exit",
                          f"aborted runs (of {args.runs}, {WORLD} processes each)"],
                         results.items()))
    save_record("gloo_exit", {"runs": args.runs, "world": WORLD, "aborted": results,
                              "torch": torch.__version__}, args.out)


if __name__ == "__main__":
    main()

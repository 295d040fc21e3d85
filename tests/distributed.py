"""Run a function on several CPU processes joined by a gloo process group, for tests (and for
the benchmarks' ranks: `benchmarks/common.py`'s `run_ranks`).

    results = run_distributed(worker, 4, arg1, arg2, timeout_s=120)

``worker(rank, world_size, *args)`` must be a module-level function (it is pickled by
reference). Each process gets ``torch.set_num_threads(1)`` and an initialised default
process group (``gloo``, rendezvous through a ``FileStore`` in a fresh temporary directory,
so no TCP port can clash). ``run_distributed`` returns the workers' return values in rank
order. If any worker raises, every process is killed and an ``AssertionError`` carrying the
worker's traceback fails the test; if the run exceeds ``timeout_s``, everything is killed and
the test fails too, so a deadlocked collective can never hang the suite.

Processes come from a ``forkserver`` that has already imported torch, so each run pays the
torch import once per test session rather than once per process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_PRELOAD = ["torch", "torch.distributed"]
_DEATH_GRACE_S = 2.0  # a process may exit just before its result reaches the queue


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _bootstrap(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures in the worker
        results.put((rank, False, traceback.format_exc()))


def _stop_all(procs: list[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _collect(procs: list[Any], results: Any, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    dead_since: float | None = None
    while len(values) < world_size:
        if time.monotonic() > deadline:
            raise AssertionError(f"distributed run timed out after {timeout_s:.0f}s")
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > _DEATH_GRACE_S:
                    codes = [p.exitcode for p in procs]
                    raise AssertionError(
                        f"a worker died without a result; exit codes {codes}"
                    ) from None
            continue
        if not ok:
            raise AssertionError(f"worker rank {rank} failed:\n{value}")
        values[rank] = value
    return [values[r] for r in range(world_size)]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; see module doc."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="longctx-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_bootstrap,
                args=(fn, rank, world_size, store_path, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            values = _collect(procs, results, world_size, timeout_s)
        except BaseException:
            _stop_all(procs, grace_s=0.0)
            raise
        _stop_all(procs, grace_s=10.0)  # let finished workers exit cleanly
    return values

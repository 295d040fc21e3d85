"""One rank of a training run under a census of live tensors (`live_activations.py`).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/census_worker.py \
        --out DIR --tokens-per-rank N -- longctx train CONFIG
    ... -- benchmarks/peer_worker.py --tool alst ...

A `TorchDispatchMode` sees every tensor an operator makes; a weak reference to each storage
of at least 256 KiB says when it is freed. After every operator the live storages with a
token dimension (a dimension of `--tokens-per-rank` tokens or of the whole row) are summed:
their sum is what grows with the row. The live set at the highest such sum is kept, and the
rank writes it to `DIR/census-<rank>.json` when its run ends (bytes, the operator that made
each storage, the innermost modules around that operator, shape, dtype); with `--timeline`
also the sum after every operator (`census-<rank>.timeline.tsv`), to see each moment. Pure
PyTorch, no change to the tool measured: longctx's ranks and the peer's script run under it
alike.

With `--account`, after every operator the rank also reads its resident set (/proc/self/statm)
and glibc's allocator statistics (`mallinfo2`: bytes in use from the heap and from mmap,
bytes freed but kept in the heap), and keeps them at the resident set's highest point beside
the census there: what the resident peak is made of (`account` in the JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as module_hooks
from torch.utils._python_dispatch import TorchDispatchMode

SMALLEST = 256 * 1024  # storages below this are left out (their sum is not what grows)
PAGE = os.sysconf("SC_PAGE_SIZE")


class MallInfo2(ctypes.Structure):  # glibc's `struct mallinfo2` (glibc 2.33 and later)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def allocator_reader():
    """A function giving {rss, heap_in_use, mmap_in_use, heap_free} in bytes now."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    statm = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115 (read per operator)

    def read() -> dict[str, int]:
        statm.seek(0)
        info = libc.mallinfo2()
        return {"rss": int(statm.read().split()[1]) * PAGE, "heap_in_use": info.uordblks,
                "mmap_in_use": info.hblkhd, "heap_free": info.fordblks}
    return read


class Census(TorchDispatchMode):
    def __init__(self, out: Path, token_dims: set[int], timeline: bool = False,
                 account: bool = False) -> None:
        super().__init__()
        self.allocator = allocator_reader() if account else None
        self.account: dict | None = None  # at the highest resident set
        self.out, self.token_dims = out, token_dims
        self.timeline: list[tuple[str, int]] | None = [] if timeline else None
        self.live: dict[int, tuple] = {}
        self.modules: list[str] = []
        self.token_bytes = 0  # the live storages' with a token dimension
        self.peak = 0
        self.at_peak: tuple[str, list[tuple]] | None = None

    def where(self, func) -> str:
        inside = "/".join(self.modules[-3:]) or "-"
        return f"{func.__name__} @ {inside}" + ("" if torch.is_grad_enabled() else " [no grad]")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, meta and the like
                continue
            if storage.nbytes() < SMALLEST:
                continue
            known = self.live.get(storage.data_ptr())
            if known is None or known[0].expired():
                if known is not None:
                    self.forget(storage.data_ptr())
                entry = (StorageWeakRef(storage), storage.nbytes(), self.where(func),
                         tuple(t.shape), str(t.dtype), bool(self.token_dims & set(t.shape)))
                self.live[storage.data_ptr()] = entry
                self.token_bytes += entry[1] if entry[5] else 0
        self.count(func)
        return out

    def forget(self, key: int) -> None:
        entry = self.live.pop(key)
        self.token_bytes -= entry[1] if entry[5] else 0

    def count(self, func) -> None:
        for key in [k for k, v in self.live.items() if v[0].expired()]:
            self.forget(key)
        if self.timeline is not None:
            self.timeline.append((self.where(func), self.token_bytes))
        if self.token_bytes > self.peak:
            self.peak = self.token_bytes
            self.at_peak = (self.where(func), list(self.live.values()))
        if self.allocator is not None:
            now = self.allocator()
            if self.account is None or now["rss"] > self.account["rss"]:
                tensors = sum(v[1] for v in self.live.values())
                self.account = {**now, "tensors": tensors, "token_tensors": self.token_bytes,
                                "at": self.where(func), "live": list(self.live.values())}

    def write(self) -> None:
        if self.account is not None:  # the high-water mark, between operators included
            status = Path("/proc/self/status").read_text()
            self.account["rss_high_water"] = 1024 * int(
                status.split("VmHWM:")[1].split()[0])
            self.account["live"] = [  # the largest storages alive at the resident peak
                {"bytes": v[1], "made_by": v[2], "shape": list(v[3]), "dtype": v[4],
                 "per_token": v[5]} for v in sorted(self.account["live"], key=lambda v: -v[1])
            ][:40]
        if self.timeline is not None:
            with self.out.with_suffix(".timeline.tsv").open("w") as f:
                f.writelines(f"{n}\t{where}\n" for where, n in self.timeline)
        if self.at_peak is None:
            return
        at, live = self.at_peak
        self.out.write_text(json.dumps({
            "account": self.account, "token_bytes": self.peak,
            "all_bytes": sum(v[1] for v in live), "at": at,
            "live": [{"bytes": v[1], "made_by": v[2], "shape": list(v[3]), "dtype": v[4],
                      "per_token": v[5]} for v in sorted(live, key=lambda v: -v[1])],
        }))


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens-per-rank", type=int, required=True)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--timeline", action="store_true",
                   help="also write the per-token bytes after every operator (.timeline.tsv)")
    p.add_argument("--account", action="store_true",
                   help="also keep the resident set and the allocator's statistics at the "
                        "resident set's highest point")
    args = p.parse_args(argv[:split])
    target = argv[split + 1:]
    args.out.mkdir(parents=True, exist_ok=True)
    census = Census(args.out / f"census-{os.environ.get('RANK', '0')}.json",
                    {args.tokens_per_rank, args.tokens_per_rank * args.sp}, args.timeline,
                    args.account)

    def enter(module, inputs) -> None:
        census.modules.append(type(module).__name__)

    def leave(module, inputs, output) -> None:  # returns None: the output stays as it is
        if census.modules:
            census.modules.pop()

    module_hooks.register_module_forward_pre_hook(enter)
    module_hooks.register_module_forward_hook(leave)
    try:
        with census:
            if target[0] == "longctx":
                from longctx_cli.rank import main as rank_main

                code = rank_main(target[1:])
            else:
                sys.argv = target
                runpy.run_path(target[0], run_name="__main__")
                code = 0
    finally:
        census.write()
    sys.exit(code)


if __name__ == "__main__":
    main()

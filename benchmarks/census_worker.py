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
the census there: what the resident peak is made of (`account` in the JSON). The census then
counts every storage, with no size floor, each of one kind (KINDS): hooks on the parameters
and the optimizer say which are weights, gradients and optimizer state; of the rest, integer
storages are the data side and float ones activations (with a token dimension) or other
floats. It also follows the step's phases (forward, the loss after the last decoder layer,
the backward of the loss and head, each decoder layer's backward with its recompute, the
gradient sum and clipping, the optimizer update) and keeps, per step and phase, the moment of
the highest resident set and the moment of the most tensor bytes, each split into those
kinds and the allocator's parts (`phases` in the JSON).
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
from torch.optim import optimizer as optimizer_hooks
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


# What a storage holds (`--account`): the hooks say which are weights, gradients and AdamW's
# state; of the rest, what is not floating point is the data side (the batch, the row's SP
# metadata, indices), a float storage with a token dimension an activation (saved for
# backward, recomputed, or a gradient of one), any other float storage "other floats".
KINDS = ("weights", "gradients", "optimizer state", "activations", "data side",
         "other floats")


def own_kind(t: torch.Tensor, per_token: bool) -> str:
    if not (t.is_floating_point() or t.is_complex()):
        return "data side"
    return "activations" if per_token else "other floats"


class Census(TorchDispatchMode):
    def __init__(self, out: Path, token_dims: set[int], timeline: bool = False,
                 account: bool = False) -> None:
        super().__init__()
        self.allocator = allocator_reader() if account else None
        self.floor = 0 if account else SMALLEST  # the account counts every storage
        self.account: dict | None = None  # at the highest resident set
        self.out, self.token_dims = out, token_dims
        self.timeline: list[tuple[str, int]] | None = [] if timeline else None
        self.live: dict[int, list] = {}  # data_ptr -> [ref, bytes, made by, shape, dtype,
        #                                               per token, kind]
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.modules: list[str] = []
        self.token_bytes = 0  # the live storages' with a token dimension
        self.peak = 0
        self.at_peak: tuple[str, list[tuple]] | None = None
        # The step's moments (`--account`): the phase now, and per (step, phase) the highest
        # resident set and the most tensor bytes, each with its parts.
        self.step, self.phase = 0, "forward"
        self.layers: dict[int, int] = {}  # id(decoder layer) -> its index
        self.layer_of: dict[int, int] = {}  # id(a layer's module) -> the layer's index
        self.seen: set[int] = set()  # modules whose parameters are watched
        self.params: set[int] = set()  # parameters with the gradient hook
        self.phases: dict[tuple[int, str], dict] = {}

    def where(self, func) -> str:
        inside = "/".join(self.modules[-3:]) or "-"
        name = func if isinstance(func, str) else func.__name__
        return f"{name} @ {inside}" + ("" if torch.is_grad_enabled() else " [no grad]")

    def add(self, storage, nbytes: int, where: str, t: torch.Tensor, kind: str | None) -> list:
        per_token = bool(self.token_dims & set(t.shape))
        kind = kind or own_kind(t, per_token)
        entry = [StorageWeakRef(storage), nbytes, where, tuple(t.shape), str(t.dtype),
                 per_token, kind]
        self.live[storage.data_ptr()] = entry
        self.token_bytes += nbytes if per_token else 0
        self.by_kind[kind] += nbytes
        return entry

    def mark(self, t: torch.Tensor | None, kind: str) -> None:
        """Say what `t`'s storage holds (a weight, a gradient, optimizer state)."""
        if t is None or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        entry = self.live.get(storage.data_ptr())
        if entry is None or entry[0].expired():
            if entry is not None:
                self.forget(storage.data_ptr())
            self.add(storage, storage.nbytes(), f"{kind} @ -", t, kind)
            return
        self.by_kind[entry[6]] -= entry[1]
        entry[6] = kind
        self.by_kind[kind] += entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, meta and the like
                continue
            if storage.nbytes() < self.floor:
                continue
            known = self.live.get(storage.data_ptr())
            if known is None or known[0].expired():
                if known is not None:
                    self.forget(storage.data_ptr())
                self.add(storage, storage.nbytes(), self.where(func), t, None)
        if self.allocator is not None:
            self.follow_phase()
        self.count(func)
        return out

    def forget(self, key: int) -> None:
        entry = self.live.pop(key)
        self.token_bytes -= entry[1] if entry[5] else 0
        self.by_kind[entry[6]] -= entry[1]

    # ---- the step's moments (`--account`) ------------------------------------------------

    def follow_phase(self) -> None:
        """Backward begins at the first operator autograd runs; it ends at the first operator
        outside autograd after it (the gradient sum and clipping, until the update)."""
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward and not self.phase.startswith("backward"):
            self.phase = "backward: loss and head"
        elif not in_backward and self.phase.startswith("backward"):
            self.phase = "gradient sum and clip"

    def watch(self, params) -> None:
        """Mark parameters as weights and their gradients, when accumulated, as gradients."""
        for p in params:
            self.mark(p, "weights")
            if p.grad is not None:
                self.mark(p.grad, "gradients")
            if id(p) not in self.params and p.requires_grad:
                self.params.add(id(p))
                p.register_post_accumulate_grad_hook(lambda p: self.mark(p.grad, "gradients"))

    def enter(self, module) -> None:
        self.modules.append(type(module).__name__)
        if self.allocator is None:
            return
        if self.phase == "after the update":
            self.phase = "forward"
        if id(module) not in self.seen:  # its parameters, and which decoder layer it is in
            layers = [m for _, m in module.named_modules()
                      if type(m).__name__.endswith("DecoderLayer") and id(m) not in self.layers]
            for index, layer in enumerate(layers):  # counted in their model, in order
                self.layers[id(layer)] = index
                self.layer_of.update((id(part), index) for part in layer.modules())
            self.seen.update(id(inner) for inner in module.modules())
            self.watch(module.parameters())
        index = self.layer_of.get(id(module))
        if index is None:
            return
        # transformers checkpoints a layer's `forward`, not its call: in backward only the
        # layer's parts run their hooks again, and the first of them says which layer it is.
        if torch._C._current_autograd_node() is not None:
            self.phase = f"backward: layer {index}"
        elif id(module) in self.layers:
            self.phase = "forward"

    def leave(self, module) -> None:
        if self.modules:
            self.modules.pop()
        index = self.layers.get(id(module))
        if (index is not None and index == max(self.layers.values()) and self.phase == "forward"
                and torch._C._current_autograd_node() is None):
            self.phase = "loss"  # the head and the loss, after the last decoder layer

    def update_begins(self, optimizer: torch.optim.Optimizer) -> None:
        self.watch(p for group in optimizer.param_groups for p in group["params"])
        self.phase = "optimizer update"

    def update_ends(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.mark(value, "optimizer state")
        self.step += 1
        self.phase = "after the update"  # zero_grad, the next batch: until a module runs
        self.modules.clear()  # a module left by an exception or a recompute

    def parts(self, now: dict[str, int], at: str) -> dict:
        tensors = sum(self.by_kind.values())
        handed_out = now["heap_in_use"] + now["mmap_in_use"]
        return {**now, "tensors": tensors, "token_tensors": self.token_bytes,
                **{k.replace(" ", "_"): v for k, v in self.by_kind.items()},
                "untracked_in_use": handed_out - tensors,
                "outside_malloc": now["rss"] - handed_out - now["heap_free"], "at": at}

    def count(self, func) -> None:
        for key in [k for k, v in self.live.items() if v[0].expired()]:
            self.forget(key)
        if self.timeline is not None:
            self.timeline.append((self.where(func), self.token_bytes))
        if self.token_bytes > self.peak:
            self.peak = self.token_bytes
            self.at_peak = (self.where(func), [tuple(v) for v in self.live.values()])
        if self.allocator is None:
            return
        now = self.allocator()
        if self.account is None or now["rss"] > self.account["rss"]:
            self.account = {**self.parts(now, self.where(func)),
                            "phase": self.phase, "step": self.step,
                            "live": [tuple(v) for v in self.live.values()]}
        moment = self.phases.setdefault((self.step, self.phase), {})
        tensors = sum(self.by_kind.values())
        if "rss_peak" not in moment or now["rss"] > moment["rss_peak"]["rss"]:
            moment["rss_peak"] = self.parts(now, self.where(func))
        if "tensor_peak" not in moment or tensors > moment["tensor_peak"]["tensors"]:
            moment["tensor_peak"] = self.parts(now, self.where(func))

    def write(self) -> None:
        def listed(live: list[tuple]) -> list[dict]:
            return [{"bytes": v[1], "made_by": v[2], "shape": list(v[3]), "dtype": v[4],
                     "per_token": v[5], **({"kind": v[6]} if self.allocator else {})}
                    for v in sorted(live, key=lambda v: -v[1])]

        if self.account is not None:  # the high-water mark, between operators included
            status = Path("/proc/self/status").read_text()
            self.account["rss_high_water"] = 1024 * int(
                status.split("VmHWM:")[1].split()[0])
            self.account["live"] = listed(self.account["live"])[:40]  # the largest
        if self.timeline is not None:
            with self.out.with_suffix(".timeline.tsv").open("w") as f:
                f.writelines(f"{n}\t{where}\n" for where, n in self.timeline)
        if self.at_peak is None:
            return
        at, live = self.at_peak
        self.out.write_text(json.dumps({
            "account": self.account, "token_bytes": self.peak,
            "all_bytes": sum(v[1] for v in live), "at": at, "live": listed(live)[:400],
            "steps": self.step,
            "phases": [{"step": step, "phase": phase, **moment}
                       for (step, phase), moment in self.phases.items()],
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

    module_hooks.register_module_forward_pre_hook(lambda module, inputs: census.enter(module))
    # Returns None: the output stays as it is.
    module_hooks.register_module_forward_hook(lambda module, i, o: census.leave(module))
    if args.account:
        optimizer_hooks.register_optimizer_step_pre_hook(
            lambda optimizer, a, k: census.update_begins(optimizer))
        optimizer_hooks.register_optimizer_step_post_hook(
            lambda optimizer, a, k: census.update_ends(optimizer))
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

"""The GPU path, measured: kernel parity, training throughput, the longest row, the estimate.

    python benchmarks/gpu.py                      # on a CUDA machine: every part
    python benchmarks/gpu.py --dry-run            # CPU, tiny sizes, same code path (< 60 s)
    python benchmarks/gpu.py --parts parity throughput

Parts (each writes into one JSON, ``benchmarks/results/gpu-<device>.json``):

* ``parity``: every attention kernel (``torch``: tiled matmul path on CUDA; ``torch_flash``:
  PyTorch's flash op; ``flash`` when flash-attn is installed, world 1 only) in bf16 and fp32,
  output and dq/dk/dv against per-document SDPA computed in float32, next to SDPA's own error
  in the same dtype (the floor). World 1 and every strategy emulated on one device: each
  rank's share (its query rows and the key range the ring gathers, its heads under
  Ulysses, both under hybrid) computed serially with the block functions the strategies
  call, key gradients summed as the reduce-scatter sums them. Communication itself is
  covered by the multi-process CPU tests.
* ``throughput``: tokens/s of one training step (bf16, gradient checkpointing, AdamW) of a
  1B-class random Llama at 8K-128K tokens, longctx (sp=1, each kernel) against plain
  Hugging Face training with ``sdpa`` and ``flash_attention_2`` (when flash-attn is
  installed). Out of memory is recorded as such.
* ``kernels``: forward and backward milliseconds of one attention call over a full row for
  each block kernel: ``torch_flash`` (PyTorch's flash-attention 2 op), ``cudnn`` (PyTorch's
  cuDNN ops: the dense op for one document, the ragged op for 4 packed ones) and ``fa4``
  (flash-attn 4, where it imports; ``cudnn+ragged-bwd``: packed rows' backward on the
  ragged op too); 32 query / 8 KV heads, head dim 64 and 128, bf16,
  causal, 8K-64K tokens. A kernel that cannot run here is recorded as skipped, with why.
* ``kernel-parity``: the ``parity`` part for ``cudnn`` and ``fa4`` (where they run) in bf16
  and fp16, every strategy, against the same float32 SDPA truth and next to SDPA's own error;
  ``cudnn`` also with its ragged backward op switched on (``cudnn+ragged-bwd``), the
  variant to adopt only if it is both right and faster here.
* ``longest``: the longest row that trains on this GPU for a Llama-3-8B-shaped random model
  with LoRA + gradient checkpointing + activation offload + chunked loss + tiled MLP
  (doubling, then bisection), with ``validate``'s estimate against the measured peak
  (``torch.cuda.max_memory_allocated``) at every length tried.

``--dry-run`` runs all of it on CPU with tiny shapes; the ``torch_flash``, ``cudnn`` and
``fa4`` kernels then call the CPU stand-ins of their ops (``tests/torch_flash_standin.py``,
``tests/cudnn_standin.py``, ``tests/fa4_standin.py``), and memory is not measured (no CUDA
allocator). Its numbers mean nothing; it proves the script runs.

A 15-minute lease (about 8 minutes of work; estimated from the earlier leases' step times,
not measured): ``python benchmarks/gpu.py --parts kernels kernel-parity throughput
--lengths 8192 16384 32768 65536 --tiled-up-to 0 --throughput-kernels torch_flash cudnn``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS, markdown_table, write_results

from longctx_cli.config import config_from_dict
from longctx_cli.config.memory_estimate import estimate_memory, tiled_scores_run
from longctx_cli.config.plan import layout_for
from longctx_cli.config.shape import ModelShape, attention_softcap
from longctx_cli.kernel_choice import (
    KernelError,
    ModelAttention,
    Platform,
    choose_kernel,
    flash_kernels_import,
)
from longctx_cli.layout import P2P_SHARDING, Layout
from longctx_cli.parallel import (
    AttentionFeatures,
    ParallelState,
    cudnn_attention,
    make_sp_meta,
    shard_batch,
)
from longctx_cli.parallel.block_geometry import full_row_segments
from longctx_cli.parallel.sharding import segments_for
from longctx_cli.parallel.torch_flash import flash_applies
from longctx_cli.parallel.torch_kernel import (
    doc_causal_backward,
    doc_causal_forward,
)
from longctx_cli.runtime.batches import to_device
from longctx_cli.runtime.memory_savers import activation_offload
from longctx_cli.runtime.model import (
    build_model,
    decoder_and_head,
    enable_checkpointing,
    model_config_of,
)
from longctx_cli.train.objectives.causal_lm import forward_loss_sum

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LLAMA_1B = {  # TinyLlama-1.1B's shape
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000, "max_position_embeddings": 131072, "rope_theta": 500000.0,
}
LLAMA3_8B = {  # Llama-3-8B's published shape
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 1048576, "rope_theta": 500000.0,
}
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 384, "max_position_embeddings": 4096,
}


# ---- parity --------------------------------------------------------------------------------


def strategy_shares(name: str, total: int, cu: list[int], hq: int, hkv: int) -> list[tuple]:
    """Each rank's share as (query rows [(start, end)], segments, q-head slice, kv-head slice).

    ``name``: ``world1``, ``ring<sp>_<layout>``, ``ulysses<sp>``, ``hybrid<sp>u<u>_<layout>``.
    """
    everything = [(0, total)]
    if name == "world1":
        return [(everything, full_row_segments(cu), slice(0, hq), slice(0, hkv))]
    kind, _, layout = name.partition("_")
    layout = layout or "contiguous"
    if kind.startswith("ulysses"):
        n = int(kind[len("ulysses"):])
        return [(everything, full_row_segments(cu), *head_slices(j, n, hq, hkv))
                for j in range(n)]
    if kind.startswith("ring"):
        n, u = int(kind[len("ring"):]), 1
    else:
        n, u = (int(x) for x in kind[len("hybrid"):].split("u"))
    r = n // u  # ranks of the ring; under hybrid each holds a Ulysses group's tokens
    shares = []
    for rank in range(r):
        ranges = Layout(sp=r, sharding=layout).local_ranges(total, rank)
        segs = segments_for(cu, ranges)
        shares += [(list(ranges), segs, *head_slices(j, u, hq, hkv)) for j in range(u)]
    return shares


def head_slices(j: int, n: int, hq: int, hkv: int) -> tuple[slice, slice]:
    """Query heads of Ulysses rank ``j`` of ``n`` and the KV heads they read."""
    per = hq // n
    group = hq // hkv
    first, last = j * per // group, ((j + 1) * per - 1) // group
    return slice(j * per, (j + 1) * per), slice(first, last + 1)


def emulate(kernel: str, share_list: list[tuple], q, k, v, dout, feats) -> list[torch.Tensor]:
    """Out and dq/dk/dv of the whole row, assembled from every rank's share."""
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    for ranges, segs, qh, kh in share_list:
        rows = torch.cat([torch.arange(a, b, device=q.device) for a, b in ranges])
        ql, dl = q[rows][:, qh], dout[rows][:, qh]
        kl, vl = k[:, kh], v[:, kh]
        o, lse = doc_causal_forward(ql, kl, vl, segs, feats, kernel=kernel)
        gq, gk, gv = doc_causal_backward(dl, ql, kl, vl, o, lse, segs, feats, kernel=kernel)
        out[rows, qh] = o.to(q.dtype)
        dq[rows, qh] = gq.to(q.dtype)
        dk[:, kh] += gk.float()
        dv[:, kh] += gv.float()
    return [out, dq, dk, dv]


def emulate_p2p(kernel: str, name: str, cu: list[int], q, k, v, dout, feats
                ) -> list[torch.Tensor]:
    """Out and dq/dk/dv of a P2P ring (``p2p<sp>_<ring_attn_func>``), every rank's every
    ring step computed serially on one device with the ring's own pieces and block functions."""
    from longctx_cli.parallel.ring_p2p import step_geometry
    from longctx_cli.parallel.torch_kernel import pieces_backward, pieces_forward

    kind, _, func = name.partition("_")
    n = int(kind[len("p2p"):])
    layout = Layout(sp=n, ring_attn_func=func, sharding=P2P_SHARDING[func], kernel=kernel)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:], strict=True)])
    metas = [make_sp_meta(pos, ParallelState(layout, sp_rank=r)) for r in range(n)]
    rows = [torch.cat([torch.arange(a, b, device=q.device) for a, b in m.local_ranges])
            for m in metas]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    for r, meta in enumerate(metas):
        ql, dl = q[rows[r]], dout[rows[r]]
        o = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((ql.shape[1], ql.shape[0]), float("-inf"), device=q.device)
        steps = [(s, (r - s) % n, *step_geometry(meta, s, feats)) for s in range(n)]
        for _, src, pieces, step_feats in steps:
            if pieces:
                pieces_forward(ql, k[rows[src]], v[rows[src]], pieces, step_feats, o, lse,
                               kernel=kernel)
        o = o.to(q.dtype)
        gq = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        for _, src, pieces, step_feats in steps:
            if pieces:
                block = (gq, torch.zeros_like(k[rows[src]]), torch.zeros_like(v[rows[src]]))
                pieces_backward(dl, ql, k[rows[src]], v[rows[src]], o, lse, pieces, step_feats,
                                block, kernel=kernel)
                dk[rows[src]] += block[1].float()
                dv[rows[src]] += block[2].float()
        out[rows[r]], dq[rows[r]] = o, gq.to(q.dtype)
    return [out, dq, dk, dv]


def sdpa_reference(q, k, v, dout, cu, feats, dtype) -> list[torch.Tensor]:
    """Per-document SDPA (is_causal, or an explicit window mask) in ``dtype``, and its grads."""
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    outs = []
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        qd, kd, vd = (t[a:b].transpose(0, 1).unsqueeze(0) for t in leaves)
        kd, vd = (t.repeat_interleave(groups, 1) for t in (kd, vd))
        if feats.window is None:
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=feats.scale)
        else:
            i = torch.arange(b - a, device=q.device)
            keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - feats.window)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=keep, scale=feats.scale)
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def parity(device: torch.device, dry: bool, results: list[dict], save,
           kernels: list[str] | None = None, dtypes: list[str] | None = None,
           strategies: list[str] | None = None) -> list[dict]:
    total, hq, hkv, dim = (256, 4, 2, 16) if dry else (16384, 32, 8, 128)
    docs = [total // 2, total // 4, total // 8, total - total // 2 - total // 4 - total // 8]
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    strategies = strategies or list(STRATEGIES)
    kernels = kernels or ["torch", "torch_flash"] + (["flash"] if flash_available() else [])
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(total, hq, dim, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(total, hkv, dim, generator=g).to(device) for _ in range(2))
    for window in (None, total // 16):
        feats = AttentionFeatures(scale=dim**-0.5, window=window)
        truth = sdpa_reference(q, k, v, dout, cu, feats, torch.float32)
        for dtype_name, dtype in DTYPES.items():
            if dtypes is not None and dtype_name not in dtypes:
                continue
            floor = sdpa_reference(q, k, v, dout, cu, feats, dtype)
            floor_err = {n: rel(a, b) for n, a, b in zip(NAMES, floor, truth, strict=True)}
            args = [t.to(dtype) for t in (q, k, v, dout)]
            for kernel in kernels:
                for strategy in strategies if kernel != "flash" else ["world1"]:
                    row = {"kernel": kernel, "dtype": dtype_name, "strategy": strategy,
                           "window": window, "tokens": total, "sdpa_err": floor_err,
                           "path": path_of(kernel, args[0], feats)}
                    try:
                        got = (flash_world1(*args, cu, feats) if kernel == "flash" else
                               emulate_p2p(kernel, strategy, cu, *args, feats)
                               if strategy.startswith("p2p") else
                               emulate(kernel, strategy_shares(strategy, total, cu, hq, hkv),
                                       *args, feats))
                        row["err"] = {n: rel(a, b) for n, a, b in zip(NAMES, got, truth,
                                                                     strict=True)}
                    except Exception as e:  # a kernel that cannot take this case says why
                        row["error"] = f"{type(e).__name__}: {e}"
                    results.append(row)
                save()
                print(f"  parity {kernel} {dtype_name} window {window}: done", flush=True)
    return results


NAMES = ("out", "dq", "dk", "dv")
STRATEGIES = ("world1", "ring2_contiguous", "ring2_zigzag", "ring4_contiguous", "ring4_zigzag",
              "ulysses2", "ulysses4", "hybrid4u2_contiguous", "hybrid4u2_zigzag",
              "p2p4_batch_ring", "p2p4_batch_zigzag", "p2p4_batch_stripe")


def path_of(kernel: str, q: torch.Tensor, feats: AttentionFeatures) -> str:
    """What computes the blocks: the kernel's ops, or the fallback where they do not apply."""
    if kernel == "cudnn":
        if cudnn_attention.applies(q, feats):
            return "cuDNN ops"
        return ("flash op (cuDNN takes no window)" if flash_applies(q, feats) else
                "tiled fallback (the ops do not apply)")
    if kernel == "fa4":
        return "flash-attn 4" if flash_applies(q, feats) else "tiled fallback"
    if kernel == "torch_flash":
        return "flash op" if flash_applies(q, feats) else "tiled fallback (op does not apply)"
    if kernel == "torch":
        return "tiled matmul" if q.is_cuda else "CPU flash op"
    return "flash-attn"


def flash_world1(q, k, v, dout, cu, feats) -> list[torch.Tensor]:
    """flash-attn's own varlen function (only where it is installed)."""
    from flash_attn import flash_attn_varlen_func

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    window = (-1, -1) if feats.window is None else (feats.window - 1, 0)
    m = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    out = flash_attn_varlen_func(*leaves, cu_t, cu_t, m, m, softmax_scale=feats.scale,
                                 causal=True, window_size=window)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


# ---- the block kernels, one attention call ---------------------------------------------

# The cuDNN kernel twice on packed rows: its default (ragged forward, dense backward per
# document) and with the ragged backward op (``cudnn_attention.use_ragged_backward``).
BENCH_KERNELS = ("torch_flash", "cudnn", RAGGED_BWD := "cudnn+ragged-bwd", "fa4")


@contextlib.contextmanager
def ragged_backward(on: bool):
    previous = cudnn_attention.use_ragged_backward(on)
    try:
        yield
    finally:
        cudnn_attention.use_ragged_backward(previous)


def kernel_unusable(kernel: str, dry: bool, dtype: str, head_dim: int) -> str | None:
    """Why ``kernel`` cannot run here (``kernel_choice``'s answer); None when it can. The dry
    run's stand-ins take anything."""
    if dry:
        return None
    try:
        choose_kernel(kernel, platform=Platform.detect(), dtype=dtype,
                      model=ModelAttention(head_dim=head_dim))
    except KernelError as err:
        return err.message
    return None


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_bench(device: torch.device, dry: bool, lengths: list[int] | None,
                 results: list[dict], save) -> list[dict]:
    """Forward and backward ms of one full-row attention call per kernel, head dim, length,
    one document or 4 packed (``cudnn`` then runs its dense op or its ragged one)."""
    hq, hkv = (4, 2) if dry else (32, 8)
    dims = (16, 32) if dry else (64, 128)
    lengths = lengths or ([128, 256] if dry else [8192, 16384, 32768, 65536])
    dtype_name = "bfloat16"
    reps = 1 if dry else 3
    for n in lengths:
        for dim in dims:
            for docs in (1, 4):
                cu = [n * i // docs for i in range(docs + 1)]
                segments = full_row_segments(cu)
                for label in BENCH_KERNELS:
                    if label == RAGGED_BWD and docs == 1:
                        continue  # one document: the dense op either way
                    kernel = "cudnn" if label == RAGGED_BWD else label
                    row = {"kernel": label, "tokens": n, "head_dim": dim, "documents": docs,
                           "heads": [hq, hkv], "dtype": dtype_name,
                           "variant": ("dense" if docs == 1 else "ragged")
                           if kernel == "cudnn" else ""}
                    why = kernel_unusable(kernel, dry, dtype_name, dim)
                    if why:
                        results.append({**row, "status": "skipped", "why": why})
                        continue

                    def run(kernel=kernel, dim=dim, segments=segments, n=n):
                        g = torch.Generator().manual_seed(n + dim)
                        q, dout = (torch.randn(n, hq, dim, generator=g).to(
                            device, DTYPES[dtype_name]) for _ in range(2))
                        k, v = (torch.randn(n, hkv, dim, generator=g).to(
                            device, DTYPES[dtype_name]) for _ in range(2))
                        feats = AttentionFeatures(scale=dim**-0.5)

                        def forward():
                            return doc_causal_forward(q, k, v, segments, feats, kernel=kernel)

                        fwd = time_ms(forward, device, reps)
                        o, lse = forward()
                        bwd = time_ms(lambda: doc_causal_backward(
                            dout, q, k, v, o, lse, segments, feats, kernel=kernel), device, reps)
                        return {"forward_ms": fwd, "backward_ms": bwd, "total_ms": fwd + bwd,
                                "path": path_of(kernel, q, feats)}
                    with ragged_backward(label == RAGGED_BWD):
                        results.append({**row, **measured(run, device)})
                    save()
                    print(f"  kernels: {results[-1]}", flush=True)
    return results


def kernel_parity(device: torch.device, dry: bool, results: list[dict], save,
                  strategies: list[str] | None = None) -> list[dict]:
    """``parity`` for the kernels added to the flash op, where they run (bf16 and fp16)."""
    dim = 16 if dry else 128
    kernels = [k for k in ("cudnn", "fa4") if not kernel_unusable(k, dry, "bfloat16", dim)]
    if not kernels:
        print("  kernel-parity: neither cudnn nor fa4 runs here", flush=True)
        return results
    parity(device, dry, results, save, kernels=kernels, dtypes=["bfloat16", "float16"],
           strategies=strategies)
    if "cudnn" in kernels:  # again with the ragged backward op, under its own name
        first = len(results)
        with ragged_backward(True):
            parity(device, dry, results, save, kernels=["cudnn"],
                   dtypes=["bfloat16", "float16"], strategies=strategies)
        for row in results[first:]:
            row["kernel"] = RAGGED_BWD
        save()
    return results


# ---- training steps ------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    """Free what the last measurement left (CUDA: its peak is measured; the CPU dry run
    measures no memory and skips the collection, seconds a row in a large process)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def longctx_config(model: dict, tokens: int, kernel: str, dtype: str, **options):
    return config_from_dict({
        "model_config": model, "dtype": dtype, "sequence_len": tokens,
        "attention_kernel": kernel, "fidelity_probe": False, "optimizer": "adamw",
        "gradient_checkpointing": True, "chunked_loss": True, **options,
    })


def timed_steps(step, steps: int, device: torch.device, profile: dict | None = None) -> float:
    """Seconds of the fastest of `steps` calls of `step` after one warm-up call; with
    `profile`, the last call runs under torch.profiler and `profile` gets its kernel table."""
    times = []
    for i in range(steps + 1):
        prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                   torch.profiler.ProfilerActivity.CUDA])
                if profile is not None and i == steps else None)
        sync(device)
        start = time.perf_counter()
        with prof if prof is not None else contextlib.nullcontext():
            step()
            sync(device)
        times.append(time.perf_counter() - start)
        if prof is not None:
            profile.update(kernel_table(prof))
    return min(times[1:])


def kernel_table(prof, rows: int = 25) -> dict:
    """The profiled step's most expensive operators by device time (self, then total)."""
    events = prof.key_averages()

    def device_us(e, total: bool) -> float:
        for name in (("device_time_total", "cuda_time_total") if total else
                     ("self_device_time_total", "self_cuda_time_total")):
            if hasattr(e, name):
                return float(getattr(e, name))
        return 0.0

    top = sorted(events, key=lambda e: device_us(e, False), reverse=True)[:rows]
    return {"self_device_ms": [{"name": e.key, "calls": e.count,
                                "ms": device_us(e, False) / 1e3} for e in top],
            "device_ms_total": sum(device_us(e, False) for e in events) / 1e3,
            "table": events.table(sort_by="self_cuda_time_total", row_limit=rows)}


def longctx_steps(config, device: torch.device, steps: int, profile: dict | None = None
                  ) -> tuple[float, int | None]:
    """Seconds per step (after one warm-up step) and peak bytes of longctx at sp=1."""
    with torch.device(device):
        model = build_model(config)
    model.to(device)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    ctx = ParallelState(Layout(kernel=config.parallel.attention_kernel))
    n = config.data.sequence_len
    ids = torch.randint(1, model_config_of(config).vocab_size, (n,))
    batch = to_device(shard_batch(ids, torch.arange(n), ids, ctx), device)

    def step() -> None:
        with activation_offload(config.memory.activation_offloading):
            (forward_loss_sum(decoder, head, batch, config, ctx) / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_steps(step, steps, device, profile), peak(device)


def hf_steps(model_dict: dict, tokens: int, attn: str, dtype, device, steps: int,
             profile: dict | None = None) -> float:
    """Plain Hugging Face training: model(input_ids, labels=...) with gradient checkpointing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_dict)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    enable_checkpointing(model, {"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(1, cfg.vocab_size, (1, tokens), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_steps(step, steps, device, profile)


def profiles(device: torch.device, dry: bool, tokens: int | None, results: list[dict],
             save, kernels: list[str] | None = None) -> list[dict]:
    """Where a step's device time goes, longctx (each of ``kernels``, default
    `torch_flash`) beside plain HF (`sdpa`): the profile names the kernels that ran."""
    model, dtype = (TINY, "float32") if dry else (LLAMA_1B, "bfloat16")
    n = tokens or (128 if dry else 16384)
    impls = [f"longctx/{k}" for k in kernels or ["torch_flash"]] + ["hf/sdpa"]
    for impl in impls:
        table: dict = {}

        def run(impl=impl, table=table):
            if impl.startswith("longctx"):
                kernel = impl.split("/", 1)[1]
                secs, _ = longctx_steps(longctx_config(model, n, kernel, dtype),
                                        device, 1, table)
            else:
                secs = hf_steps(model, n, "sdpa", DTYPES[dtype], device, 1, table)
            return {"seconds": secs, **table}
        results.append({"tokens": n, "impl": impl, **measured(run, device)})
        save()
        print(f"  profile {impl} {n}: {results[-1].get('seconds')}", flush=True)
        print(results[-1].get("table", results[-1].get("error", "")), flush=True)
    return results


def measured(fn, device: torch.device) -> dict:
    """Run one measurement; out-of-memory and other failures become results, not crashes."""
    reset_memory(device)
    try:
        return {"status": "ok", **fn()}
    except Exception as e:
        if is_oom(e):
            return {"status": "oom"}
        return {"status": "error", "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=3)}
    finally:
        reset_memory(device)


def throughput(device: torch.device, dry: bool, lengths: list[int] | None,
               tiled_up_to: int, results: list[dict], save,
               kernels: list[str] | None = None) -> list[dict]:
    """``tiled_up_to``: the longest row the ``torch`` kernel (tiled matmuls on CUDA, the
    slowest) is timed at, so that a lease of minutes reaches the longer rows. ``kernels``:
    the longctx kernels timed (default torch_flash, torch, and flash where installed)."""
    model, dtype = (TINY, "float32") if dry else (LLAMA_1B, "bfloat16")
    lengths = lengths or ([128, 256] if dry else [8192, 16384, 32768, 65536, 131072])
    steps = 1 if dry else 2
    kernels = kernels or ["torch_flash", "torch"] + (["flash"] if flash_available() else [])
    hf = ["sdpa"] + ([] if dry or not importable("flash_attn") else ["flash_attention_2"])
    for n in lengths:
        for kernel in kernels:
            if kernel == "torch" and n > tiled_up_to:
                continue
            def run(kernel=kernel, n=n):
                secs, top = longctx_steps(longctx_config(model, n, kernel, dtype), device, steps)
                return {"tokens_per_s": n / secs, "peak_bytes": top}
            results.append({"tokens": n, "impl": f"longctx/{kernel}", **measured(run, device)})
            save()
            print(f"  throughput: {results[-1]}", flush=True)
        for attn in hf:
            def run_hf(attn=attn, n=n):
                secs = hf_steps(model, n, attn, DTYPES[dtype], device, steps)
                return {"tokens_per_s": n / secs, "peak_bytes": peak(device)}
            results.append({"tokens": n, "impl": f"hf/{attn}", **measured(run_hf, device)})
            save()
            print(f"  throughput: {results[-1]}", flush=True)
    return results


def flash_available() -> bool:
    """CUDA, and flash-attn 2 + ring-flash-attn really import (what `auto` looks at)."""
    return torch.cuda.is_available() and flash_kernels_import() is None


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ---- the longest row ---------------------------------------------------------------------


def estimate_bytes(config, kernel: str, cuda: bool) -> int:
    shape = ModelShape.from_hf_config(model_config_of(config))
    tiled = tiled_scores_run(kernel, cuda, shape)
    return estimate_memory(config, shape, 1, layout_for(config, 1, None),
                           host_is_device=not cuda,
                           tiled_scores=tiled)[0].total


def longest(device: torch.device, dry: bool, max_trials: int, lengths: list[int] | None,
            report: dict, save) -> dict:
    """Doubling then bisection from 32K, or (``lengths``) exactly the rows given: an 8B
    step at hundreds of thousands of tokens takes minutes, more than a short lease holds."""
    model = TINY if dry else LLAMA3_8B
    cuda = device.type == "cuda"
    options = {"adapter": "lora", "lora_r": 16, "lora_target_modules": "all-linear",
               "activation_offloading": True, "tiled_mlp": True, "loss_chunk_size": 4096}
    kernel = choose_kernel("auto", platform=Platform.detect(), dtype="bfloat16").kernel
    if not cuda:  # the dry run exercises the GPU's kernel through the stand-in
        kernel = "torch_flash"
    n, step = (128, 128) if dry else (32768, 16384)
    trials: list[dict] = []
    ok, bad = 0, None
    fixed = list(lengths or [])
    if fixed:
        n, max_trials = fixed.pop(0), len(lengths)
    report["longest"] = {"model": "tiny" if dry else "llama3-8b shape", "kernel": kernel,
                         "options": options, "trials": trials,
                         "search": "given rows" if lengths else "doubling, then bisection"}
    while len(trials) < max_trials:
        config = longctx_config(model, n, kernel, "bfloat16", **options)
        est = estimate_bytes(config, kernel, cuda)
        result = measured(lambda config=config: dict(zip(
            ("seconds", "peak_bytes"), longctx_steps(config, device, 1), strict=True)),
            device)
        row = {"tokens": n, "estimate_bytes": est, **result}
        if result["status"] == "ok" and result.get("peak_bytes"):
            row["estimate_error"] = est / result["peak_bytes"] - 1
        trials.append(row)
        save()
        print(f"  longest: {n} tokens -> {result['status']}", flush=True)
        if result["status"] == "ok":
            ok = n
        elif result["status"] == "oom":
            bad = n
        else:
            break
        if fixed:
            n = fixed.pop(0)
            continue
        if lengths:
            break
        if bad is None:
            n *= 2
        elif bad - ok <= step:
            break
        else:
            n = (ok + bad) // 2 // step * step
    report["longest"].update({
        "longest_tokens": ok, "first_oom_tokens": bad,
        "softcap": attention_softcap(ModelShape.from_hf_config(model_config_of(
            longctx_config(model, 128, kernel, "bfloat16"))))})
    save()
    return report["longest"]


# ---- main ---------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-dry-run"
    return torch.cuda.get_device_name(device).lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, stand-in op")
    parser.add_argument("--parts", nargs="+", default=["parity", "throughput", "longest"],
                        choices=["parity", "throughput", "longest", "profile", "kernels",
                                 "kernel-parity"])
    parser.add_argument("--throughput-kernels", nargs="+", default=None,
                        choices=["torch_flash", "torch", "flash", "cudnn", "fa4"],
                        help="longctx kernels `throughput` times (default torch_flash, torch, "
                             "flash where installed)")
    parser.add_argument("--profile-kernels", nargs="+", default=None,
                        choices=["torch_flash", "torch", "flash", "cudnn", "fa4"],
                        help="longctx kernels the `profile` part profiles (default torch_flash)")
    parser.add_argument("--kernel-lengths", type=int, nargs="+", default=None,
                        help="rows of the `kernels` part (default 8K-64K)")
    parser.add_argument("--strategies", nargs="+", default=None, choices=STRATEGIES,
                        help="strategies of the parity parts (default all)")
    parser.add_argument("--max-trials", type=int, default=8, help="rows tried by `longest`")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="rows timed by `throughput` (default 8K-128K)")
    parser.add_argument("--tiled-up-to", type=int, default=1 << 30,
                        help="longest row `throughput` times the `torch` kernel at")
    parser.add_argument("--profile-tokens", type=int, default=None,
                        help="row length of the `profile` part (default 16K)")
    parser.add_argument("--longest-lengths", type=int, nargs="+", default=None,
                        help="`longest` tries exactly these rows instead of searching")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON, rewritten after every row "
                             "(default results/gpu-<device>.json)")
    parser.add_argument("--table", type=Path, default=None,
                        help="print the markdown tables of a results JSON and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(tables(json.loads(args.table.read_text())))
        return {}
    if args.dry_run:
        from longctx_cli.parallel.cudnn_attention import use_cudnn_ops
        from longctx_cli.parallel.fa4_attention import ops_for, use_fa4_ops
        from longctx_cli.parallel.torch_flash import use_flash_ops
        from tests import cudnn_standin, fa4_standin
        from tests.torch_flash_standin import OPS

        use_flash_ops(OPS)  # the GPU kernels' code paths, on CPU stand-ins of their ops
        use_cudnn_ops(cudnn_standin.OPS)
        use_fa4_ops(ops_for(fa4_standin.MODULE, supports=lambda q: True, name="stand-in"))
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run, or on a GPU machine")
    else:
        device = torch.device("cuda")
    report: dict = {"device": device_name(device), "dry_run": args.dry_run,
                    "torch": torch.__version__, "flash_attn": importable("flash_attn"),
                    "measured": not args.dry_run}
    if not args.dry_run:
        report["gpu_capability"] = list(torch.cuda.get_device_capability(device))
    started = time.perf_counter()
    out = args.out or RESULTS / f"gpu-{report['device']}.json"

    def save() -> None:  # after every row: a run cut short keeps what it measured
        report["seconds"] = time.perf_counter() - started
        write_results(out, report)

    if "parity" in args.parts:
        parity(device, args.dry_run, report.setdefault("parity", []), save,
               strategies=args.strategies)
    if "kernels" in args.parts:
        kernel_bench(device, args.dry_run, args.kernel_lengths,
                     report.setdefault("kernels", []), save)
    if "kernel-parity" in args.parts:
        kernel_parity(device, args.dry_run, report.setdefault("kernel_parity", []), save,
                      args.strategies)
    if "throughput" in args.parts:
        throughput(device, args.dry_run, args.lengths, args.tiled_up_to,
                   report.setdefault("throughput", []), save, args.throughput_kernels)
    if "profile" in args.parts:
        profiles(device, args.dry_run, args.profile_tokens, report.setdefault("profile", []),
                 save, args.profile_kernels)
    if "longest" in args.parts:
        longest(device, args.dry_run, 3 if args.dry_run else args.max_trials,
                args.longest_lengths, report, save)
    save()
    print(summary(report))
    print(f"written to {out}")
    return report


def tables(report: dict) -> str:
    """Markdown tables of a results JSON, each `longest` row's estimate recomputed by the
    current code (what `validate` prints now) beside the peak measured then."""
    gib = 1024**3
    lines = [f"{report['device']}, torch {report['torch']}"]
    for key in ("parity", "kernel_parity"):
        lines += parity_table(report.get(key, []))
    lines += kernels_table(report.get("kernels", []))
    rows = report.get("throughput", [])
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    if rows:
        cells = []
        for n in lengths:
            cells.append([f"{n:,}"])
            for impl in impls:
                r = next((r for r in rows if r["tokens"] == n and r["impl"] == impl), None)
                cells[-1].append("-" if r is None else r["status"] if r["status"] != "ok" else
                                 f"{r['tokens_per_s']:,.0f} ({r['peak_bytes'] / gib:.1f})")
        lines += ["", markdown_table(["tokens", *(f"`{i}` tok/s (peak GiB)" for i in impls)],
                                     cells)]
    if "longest" in report:
        lg = report["longest"]
        model = TINY if report.get("dry_run") else LLAMA3_8B
        cells = []
        for t in lg["trials"]:
            if t["status"] != "ok" or not t.get("peak_bytes"):
                cells.append([f"{t['tokens']:,}", t["status"], "", ""])
                continue
            config = longctx_config(model, t["tokens"], lg["kernel"], "bfloat16", **lg["options"])
            est = estimate_bytes(config, lg["kernel"], True)
            cells.append([f"{t['tokens']:,}", f"{t['peak_bytes'] / gib:.2f}", f"{est / gib:.2f}",
                          f"{est / t['peak_bytes']:.2f}"])
        lines += ["", markdown_table(["tokens", "measured peak GiB", "estimate now GiB",
                                      "estimate / peak"], cells)]
    return "\n".join(lines)


def parity_table(rows: list[dict]) -> list[str]:
    """Worst error per kernel and dtype over strategies and windows, beside SDPA's own."""
    if not rows:
        return []
    worst: dict = {}
    for row in rows:
        key = (row["kernel"], row["dtype"])
        err = max(row["err"].values()) if "err" in row else float("nan")
        floor = max(row["sdpa_err"].values())
        old = worst.get(key, (0.0, 0.0))
        worst[key] = (max(old[0], err), max(old[1], floor))
    return ["", *markdown_table(
        ["kernel", "dtype", "worst relative error, any strategy and window", "SDPA's own"],
        ([f"`{kernel}`", dtype, f"{err:.2e}", f"{floor:.2e}"]
         for (kernel, dtype), (err, floor) in worst.items())).splitlines()]


def kernels_table(rows: list[dict]) -> list[str]:
    """Forward + backward ms per (tokens, head dim, documents), one column per kernel
    (``cudnn`` is its dense op for one document, its ragged op for several)."""
    if not rows:
        return []
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    keys = list(dict.fromkeys((r["tokens"], r["head_dim"], r["documents"]) for r in rows))
    cells = []
    for n, dim, docs in keys:
        cells.append([f"{n:,}", dim, docs])
        for kernel in kernels:
            r = next((r for r in rows if (r["tokens"], r["head_dim"], r["documents"], r["kernel"])
                      == (n, dim, docs, kernel)), None)
            cells[-1].append("-" if r is None else r["status"] if r["status"] != "ok" else
                             f"{r['forward_ms']:.1f} + {r['backward_ms']:.1f}")
    return ["", *markdown_table(["tokens", "head dim", "documents",
                                 *(f"`{k}` fwd + bwd ms" for k in kernels)], cells).splitlines()]


def summary(report: dict) -> str:
    lines = [f"device {report['device']} (measured: {report['measured']})"]
    for row in report.get("parity", []) + report.get("kernel_parity", []):
        err = row.get("err")
        what = (f"max err {max(err.values()):.2e} (sdpa {max(row['sdpa_err'].values()):.2e})"
                if err else row.get("error", ""))
        lines.append(f"  parity {row['kernel']:<11} {row['dtype']:<8} {row['strategy']:<20} "
                     f"window {row['window']}: {what}")
    for row in report.get("kernels", []):
        ms = (f"{row['forward_ms']:.2f} + {row['backward_ms']:.2f} ms" if row["status"] == "ok"
              else f"{row['status']} {row.get('why', row.get('error', ''))}")
        lines.append(f"  kernels {row['kernel']:<11} {row['tokens']:>7} d{row['head_dim']} "
                     f"x{row['documents']}: {ms}")
    for row in report.get("throughput", []):
        tps = f"{row['tokens_per_s']:.0f} tok/s" if row["status"] == "ok" else row["status"]
        lines.append(f"  throughput {row['impl']:<18} {row['tokens']:>7}: {tps}")
    if "longest" in report:
        lg = report["longest"]
        lines.append(f"  longest row ({lg['model']}, {lg['kernel']}): {lg['longest_tokens']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

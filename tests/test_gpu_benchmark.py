"""`benchmarks/gpu.py --dry-run` runs the GPU benchmark's code path on CPU (tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu-dry.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and not report["measured"]
    parity = report["parity"]
    assert {r["strategy"] for r in parity} >= {"world1", "ring4_zigzag", "ulysses4",
                                               "hybrid4u2_zigzag", "p2p4_batch_ring",
                                               "p2p4_batch_zigzag", "p2p4_batch_stripe"}
    assert {r["dtype"] for r in parity} == {"bfloat16", "float16", "float32"}
    assert {r["kernel"] for r in parity} >= {"torch", "torch_flash"}
    for row in parity:  # fp32 through the CPU stand-in: exact up to rounding
        assert "err" in row, row
        if row["dtype"] == "float32":
            assert max(row["err"].values()) < 1e-5, row
    assert all(r["status"] == "ok" for r in report["throughput"]), report["throughput"]
    assert report["longest"]["trials"] and report["longest"]["kernel"] == "torch_flash"


def gpu_tables(results: Path) -> list[str]:
    """The markdown rows `gpu.py --table` prints for `results` (headers left out)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--table", str(results)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| tokens") and "---" not in line
            and not line.startswith("| kernel")]


@pytest.mark.slow  # spawns gpu.py per file; figures.py --check (test_front_door) covers the blocks
def test_the_gpu_tables_in_the_docs_are_the_results_files() -> None:
    """docs/gpu.md's tables are what `gpu.py --table` prints from the results files (the
    estimate column recomputed by the current code), row for row: parity from the H100's
    first lease, throughput from its second and from both H200 leases, the estimate from the
    H200's (measured with the code that estimates it now)."""
    results = ROOT / "benchmarks" / "results"
    first = gpu_tables(results / "gpu-nvidia-h100-80gb-hbm3-2026-11-27.json")
    second = gpu_tables(results / "gpu-nvidia-h100-80gb-hbm3-2026-11-27-remeasured.json")
    third = gpu_tables(results / "gpu-nvidia-h200-2026-11-27.json")
    fourth = gpu_tables(results / "gpu-nvidia-h200-2026-11-27-second.json")
    parity = [r for r in first if r.startswith("| `")]
    throughput = [r for r in second + third + fourth if r.count("|") == 4 and "(" in r]
    estimate = [r for r in third if r.count("|") == 5]
    assert len(parity) == 6 and len(throughput) == 12 and len(estimate) == 3, (first, third)
    assert [r for r in fourth if r.count("|") == 5] == estimate  # the same peaks, the same code
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for row in parity + throughput + estimate:
        assert row in docs, row


def test_gpu_benchmark_profile_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu-profile.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--parts",
         "profile", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["profile"]
    assert [r["impl"] for r in rows] == ["longctx/torch_flash", "hf/sdpa"]
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["self_device_ms"] is not None
               for r in rows), rows


def test_kernel_parts_dry_run(tmp_path: Path) -> None:
    """The `kernels` and `kernel-parity` parts run (in this process, through `gpu.main`, the
    script's own entry point) on CPU through the stand-ins of the torch_flash, cudnn and fa4
    ops, and their JSON and table have the shape the docs use."""
    import torch

    from longctx_cli.parallel.cudnn_attention import cudnn_ops, use_cudnn_ops
    from longctx_cli.parallel.fa4_attention import use_fa4_ops
    from longctx_cli.parallel.torch_flash import flash_ops, use_flash_ops

    gpu = _gpu_module()
    out = tmp_path / "gpu-kernels.json"
    saved = (flash_ops(), cudnn_ops(), use_fa4_ops(None), torch.get_num_threads())
    try:
        gpu.main(["--dry-run", "--parts", "kernels", "kernel-parity", "--kernel-lengths", "64",
                  "--strategies", "world1", "hybrid4u2_zigzag", "p2p4_batch_zigzag",
                  "--out", str(out)])
    finally:  # the dry run installs the stand-ins and one thread for this process
        use_flash_ops(saved[0])
        use_cudnn_ops(saved[1])
        use_fa4_ops(saved[2])
        torch.set_num_threads(saved[3])
    report = json.loads(out.read_text())
    rows = report["kernels"]
    assert {(r["kernel"], r["head_dim"], r["documents"]) for r in rows} == {
        (k, d, n) for k in ("torch_flash", "cudnn", "fa4") for d in (16, 32) for n in (1, 4)
    } | {("cudnn+ragged-bwd", d, 4) for d in (16, 32)}
    for r in rows:
        assert r["status"] == "ok" and r["forward_ms"] > 0 and r["backward_ms"] > 0, r
    cudnn = {r["documents"]: r for r in rows if r["kernel"] == "cudnn"}
    assert cudnn[1]["variant"] == "dense" and cudnn[4]["variant"] == "ragged"
    assert cudnn[1]["path"] == "cuDNN ops"
    parity = report["kernel_parity"]
    assert {r["kernel"] for r in parity} == {"cudnn", "cudnn+ragged-bwd", "fa4"}
    assert {r["dtype"] for r in parity} == {"bfloat16", "float16"}
    assert len({r["strategy"] for r in parity}) == 3
    for r in parity:  # half precision through the stand-ins: within SDPA's own error
        assert max(r["err"].values()) <= 1.5 * max(r["sdpa_err"].values()), r
    windowed = [r for r in parity if r["kernel"] == "cudnn" and r["window"]]
    assert windowed and all(r["path"] == "flash op (cuDNN takes no window)" for r in windowed)
    table = gpu.tables(report).splitlines()
    assert sum(r.startswith("| 64 | ") for r in table) == 4  # 2 head dims x 1 or 4 documents
    assert sum(r.startswith(("| `cudnn", "| `fa4` | ")) for r in table) == 6


def _gpu_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    return gpu


def test_kernels_table_and_skips_on_a_machine_without_the_kernels() -> None:
    gpu = _gpu_module()

    why = gpu.kernel_unusable("cudnn", False, "bfloat16", 128)
    assert why is not None and "no CUDA GPU" in why
    assert gpu.kernel_unusable("cudnn", True, "bfloat16", 128) is None  # stand-ins
    rows = [{"kernel": "torch_flash", "tokens": 8192, "head_dim": 128, "documents": 4,
             "status": "ok", "forward_ms": 1.25, "backward_ms": 3.5},
            {"kernel": "fa4", "tokens": 8192, "head_dim": 128, "documents": 4,
             "status": "skipped", "why": why}]
    assert gpu.kernels_table(rows)[1:] == [
        "| tokens | head dim | documents | `torch_flash` fwd + bwd ms | `fa4` fwd + bwd ms |",
        "|---|---|---|---|---|",
        "| 8,192 | 128 | 4 | 1.2 + 3.5 | skipped |",
    ]

"""`benchmarks/gpu.py --dry-run` runs the GPU benchmark's code path on CPU (tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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

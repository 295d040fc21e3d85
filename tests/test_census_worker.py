"""`benchmarks/census_worker.py`: the live tensors with a token dimension at their highest."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024

KEPT = """
    import torch
    w = torch.randn(256, 256)
    kept = [torch.randn(1024, 256) @ w for _ in range(4)]
    del kept
    torch.zeros(1).add_(1)
"""
# One operator's transient, larger than what was kept: the census sums after every operator.
TRANSIENT = """
    import torch
    w = torch.randn(256, 256)
    kept = [torch.randn(1024, 256) @ w for _ in range(4)]
    del kept
    torch.randn(1024, 256 * 6).sum()
"""


@pytest.mark.parametrize(("work", "peak_mib", "made_by"), [
    # Four [1024, 256] float32 products (1 MiB each) alive at once, and the fifth's input
    # beside the last of them; the weight has no token dimension and is left out of the sum.
    (KEPT, 5, {"mm": 4, "randn": 1}),
    (TRANSIENT, 6, {"randn": 1}),
])
def test_the_census_finds_the_tensors_alive_at_the_peak(tmp_path: Path, work: str,
                                                       peak_mib: int, made_by: dict) -> None:
    script = tmp_path / "work.py"
    script.write_text(textwrap.dedent(work))
    out = tmp_path / "census"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "census_worker.py"), "--out", str(out),
         "--tokens-per-rank", "1024", "--sp", "1", "--", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "census-0.json").read_text())
    assert record["token_bytes"] == peak_mib * MIB
    per_token = [t for t in record["live"] if t["per_token"]]
    ops = [t["made_by"].split(".")[0] for t in per_token]
    assert {op: ops.count(op) for op in ops} == made_by
    assert any(not t["per_token"] and t["shape"] == [256, 256] for t in record["live"])

"""`benchmarks/census_worker.py`: the live tensors with a token dimension at their highest."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_census_finds_the_tensors_alive_at_the_peak(tmp_path: Path) -> None:
    script = tmp_path / "work.py"
    # Four [1024, 256] float32 tensors (1 MiB each) alive at once, then freed; the weight has
    # no token dimension and is left out of the per-token sum.
    script.write_text(textwrap.dedent("""
        import torch
        w = torch.randn(256, 256)
        kept = [torch.randn(1024, 256) @ w for _ in range(4)]
        for _ in range(40):  # enough operators for the census to sum at least once
            torch.zeros(1).add_(1)
        del kept
        for _ in range(40):
            torch.zeros(1).add_(1)
    """))
    out = tmp_path / "census"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "census_worker.py"), "--out", str(out),
         "--tokens-per-rank", "1024", "--sp", "1", "--", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "census-0.json").read_text())
    assert record["token_bytes"] == 4 * 1024 * 256 * 4
    per_token = [t for t in record["live"] if t["per_token"]]
    assert len(per_token) == 4 and all(t["made_by"].startswith("mm") for t in per_token)
    assert any(not t["per_token"] and t["shape"] == [256, 256] for t in record["live"])

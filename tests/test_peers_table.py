"""The README's table against DeepSpeed ALST is what `benchmarks/peers.py --table PEERS
--reach REACH --live LIVE` prints from the results files the README names, row for row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_peer_table_is_the_results_files():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`python\s+benchmarks/peers\.py\s+--table\s+(\S+)\s+--reach\s+(\S+)"
                        r"\s+--live\s+(\S+)`", readme)
    assert command, "the README names the command that prints its peer table"
    files = [ROOT / command.group(i) for i in (1, 2, 3)]
    assert all(f.is_file() for f in files), command.group(0)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--table", str(files[0]),
         "--reach", str(files[1]), "--live", str(files[2])],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 5, proc.stdout  # the heading and four tools
    for row in rows:
        assert row in readme, row

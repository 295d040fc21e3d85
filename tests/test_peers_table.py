"""The README's table against DeepSpeed ALST is what `benchmarks/peers.py --table PEERS
--reach REACH` prints from the results files the README names, row for row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_peer_table_is_the_results_files():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`python\s+benchmarks/peers\.py\s+--table\s+(\S+)\s+--reach\s+(\S+)`",
                        readme)
    assert command, "the README names the command that prints its peer table"
    peers_file, reach_file = ROOT / command.group(1), ROOT / command.group(2)
    assert peers_file.is_file() and reach_file.is_file(), command.group(0)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--table", str(peers_file),
         "--reach", str(reach_file)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 5, proc.stdout  # the heading and four tools
    for row in rows:
        assert row in readme, row

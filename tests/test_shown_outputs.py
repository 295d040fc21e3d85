"""Every command output README.md and docs/*.md show is what the code prints now
(tests/shown_outputs.py: output blocks rerun and compared, log excerpts held to the code's
line formats and the example's plan)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shown_outputs import PAGES, ROOT, blocks, check, check_log, normalise


def test_every_shown_output_is_current():
    problems = check()
    assert not problems, ("\n\n".join(problems)
                          + "\n\nRegenerate with `python -m tests.shown_outputs`.")


def test_the_pages_show_outputs_of_both_kinds():
    kinds = {(page.name, block.kind) for page in PAGES for block in blocks(page)}
    assert ("training.md", "log") in kinds and ("cli.md", "output") in kinds


def test_every_shown_log_line_is_from_one_recorded_run():
    """The log excerpts of a config, on every page, are lines of one run: the newest
    `benchmarks/results/train-<config>-<date>.log`, a whole run's output as it printed."""
    shown = [(page, b) for page in PAGES for b in blocks(page) if b.kind == "log"]
    assert shown
    for page, block in shown:
        config = Path(block.command.split()[2]).stem
        logs = sorted((ROOT / "benchmarks" / "results").glob(f"train-{config}-*.log"))
        assert logs, f"no recorded run of {config} under benchmarks/results/"
        printed = set(logs[-1].read_text().splitlines())
        stray = [line for line in block.body.splitlines()
                 if line.strip() not in ("", "...") and line not in printed]
        assert not stray, f"{page.name}: not lines of {logs[-1].name}: {stray}"


@pytest.mark.parametrize("line", [
    "step 50/2000 loss 0.2570 learning_rate 2.00e-03 grad_norm 1.276 tokens/s 18298",
    "layout: dp 1, sp 2 (ring: 2 ulysses x 1 ring), sharding zigzag, ring varlen_llama3, "
    "kernel torch (requested)",
    "step 50/3000 loss 0.2570 lr 2.00e-03 grad_norm 1.276 tokens/s 18298",
    "first step 9.2 s after the command (launcher imports 0.5, warm-up 0.1)",
    "fidelity probe: passed: a tiny model",
])
def test_a_log_line_the_code_would_not_print_is_caught(line):
    assert check_log("longctx train examples/tiny_passkey.yaml --nproc-per-node 2", line)


def test_timings_and_float_noise_do_not_count():
    shown = "eager forward(labels=) (0.3s)\nloss rel. err 0.0e+00, worst 2.2e-06\nvalid"
    printed = "eager\nforward(labels=) (12.5s)\nloss rel. err 1.0e-07, worst 3.1e-06 valid"
    assert normalise(shown) == normalise(printed)
    assert normalise("tolerance 0.0001") != normalise("tolerance 0.001")

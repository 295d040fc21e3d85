"""Ranks leave cleanly whichever way a run ends: no "terminate called without an active
exception" (SIGABRT) at exit.

A Gloo process group still alive when a process exits is torn down during interpreter
finalization, where its worker threads can call `std::terminate` (`benchmarks/gloo_exit.py`:
1 of 16 plain gloo jobs that skip `destroy_process_group` aborted here, 0 of 16 that call
it). Every rank path of longctx runs inside `runtime.distributed.process_group_released`,
which destroys the group and collects what holds it before the interpreter finalizes. These
loops run the paths where the abort was seen (a finished TP run, a run stopped early by a
rule) several times each.
"""

from __future__ import annotations

import pytest

from tests.train_helpers import run_longctx, write_config, write_documents

RUNS = 8
ABORT = ("terminate called", "SIGABRT", "exitcode: -6", "exit code -6")

PATHS = {
    # A finished run under tensor parallelism (DTensor parameters hold the device mesh).
    "tp2_finished": ({"tensor_parallel_size": 2}, 0),
    # Stopped by the loss watchdog after its first steps: a UserError on every rank.
    "watchdog_stop": ({"sequence_parallel_degree": 2, "loss_watchdog_threshold": 0.5,
                       "loss_watchdog_patience": 1}, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_ranks_exit_without_abort(tmp_path, path):
    overrides, status = PATHS[path]
    data = write_documents(tmp_path / "docs.jsonl")
    config = write_config(tmp_path, "run", data, max_steps=3, eval_steps=None, **overrides)
    for attempt in range(RUNS):
        result = run_longctx("train", str(config), "--nproc-per-node", "2", "--overwrite")
        output = result.stdout + result.stderr
        assert result.returncode == status, (attempt, output[-3000:])
        assert not any(word in output for word in ABORT), (attempt, output[-3000:])

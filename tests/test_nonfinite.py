"""Divergence guard: a NaN stops the run with step, rank and tensor and keeps the last good
checkpoint (`on_nonfinite: stop`), or drops that step and goes on (`on_nonfinite: skip`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.shown_outputs import assert_shown_message
from tests.train_helpers import IN_A_RANK, read_metrics, run_longctx, write_config, write_documents

# Test-only faults for the ranks, loaded through PYTHONPATH: a rank is a process torchrun
# started (RANK set) or a warm process that will run one (launcher/warm_ranks.py; RANK arrives
# with the hand-over, so the faulty rank is picked at call time).
FAULTS = f"""
import os, sys
if {IN_A_RANK}:
    import torch
    def _faulty_rank():
        return os.environ.get("RANK") == os.environ.get("LONGCTX_TEST_FAULT_RANK")
    _poison_after = int(os.environ.get("LONGCTX_TEST_POISON_WEIGHT_AFTER_STEP", "0"))
    if _poison_after:
        # After optimizer step N, one weight of this rank becomes NaN for good.
        _adamw_step = torch.optim.AdamW.step
        _steps = [0]
        def _step(self, *args, **kwargs):
            out = _adamw_step(self, *args, **kwargs)
            _steps[0] += 1
            if _steps[0] == _poison_after and _faulty_rank():
                with torch.no_grad():
                    self.param_groups[0]["params"][0].fill_(float("nan"))
            return out
        torch.optim.AdamW.step = _step
    _nan_backward = int(os.environ.get("LONGCTX_TEST_NAN_BACKWARD", "0"))
    if _nan_backward:
        # The N-th backward of this rank (step N when gradient_accumulation_steps is 1)
        # produces NaN gradients once; the weights stay finite.
        _backward = torch.Tensor.backward
        _calls = [0]
        def _poisoned_backward(self, *args, **kwargs):
            _calls[0] += 1
            if _calls[0] == _nan_backward and _faulty_rank():
                self = self * float("nan")
            return _backward(self, *args, **kwargs)
        torch.Tensor.backward = _poisoned_backward
"""


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    data = write_documents(tmp_path / "docs.jsonl", seed=5)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULTS)
    return tmp_path, data, faults


def test_nan_loss_stops_with_step_rank_and_keeps_last_checkpoint(setup):
    path, data, faults = setup
    config = write_config(
        path,
        "stop",
        data,
        sequence_parallel_degree=2,
        gradient_accumulation_steps=1,
        max_steps=6,
        save_steps=2,
    )
    env = {
        "PYTHONPATH": str(faults),
        "LONGCTX_TEST_FAULT_RANK": "1",
        "LONGCTX_TEST_POISON_WEIGHT_AFTER_STEP": "3",
    }
    result = run_longctx("train", str(config), "--nproc-per-node", "2", env=env, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-4000:]
    assert "step 4: the loss on rank(s) [" in out and "NaN or infinite" in out, out[-4000:]
    assert "checkpoint-2" in out and "on_nonfinite" in out
    assert_shown_message("nonfinite-stop", out)
    assert "Traceback" not in out
    output_dir = path / "stop"
    assert [m["step"] for m in read_metrics(output_dir)] == [1, 2, 3]
    assert not (output_dir / "final").exists()
    _assert_checkpoint_loads(config, output_dir / "checkpoint-2", step=2)


def _assert_checkpoint_loads(config_path: Path, checkpoint: Path, step: int) -> None:
    """The kept checkpoint restores into a fresh model, with finite weights."""
    from transformers import get_scheduler

    from longctx_cli.config import load_config
    from longctx_cli.runtime.model import build_model
    from longctx_cli.train.checkpoint_files import load_checkpoint, resolve_resume

    assert resolve_resume("auto", checkpoint.parent) == checkpoint
    config = load_config(config_path)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.training.learning_rate)
    scheduler = get_scheduler("constant", optimizer)
    state = load_checkpoint(checkpoint, model, optimizer, scheduler)
    assert state["step"] == step
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name


@pytest.mark.slow  # the non-finite check stays by default in the stop test above
def test_skip_drops_the_bad_step_and_finishes(setup):
    path, data, faults = setup
    config = write_config(
        path, "skip", data, gradient_accumulation_steps=1, max_steps=5, on_nonfinite="skip",
        fidelity_probe=False,  # the probe's own backward calls would shift the fault's count
    )
    env = {
        "PYTHONPATH": str(faults),
        "LONGCTX_TEST_FAULT_RANK": "0",
        "LONGCTX_TEST_NAN_BACKWARD": "3",
    }
    result = run_longctx("train", str(config), "--nproc-per-node", "1", env=env, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(path / "skip")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m.get("skipped", False) for m in metrics] == [False, False, True, False, False]
    assert not math.isfinite(metrics[2]["grad_norm"])
    # Steps after the skipped one train on finite weights, and the model is exported.
    assert all(math.isfinite(m["loss"]) for i, m in enumerate(metrics) if i != 2)
    weights = load_file(str(path / "skip" / "final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())

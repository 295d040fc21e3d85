"""Damaged checkpoints and a full disk cost nothing that was already saved.

- a truncated shard in the newest checkpoint is reported and skipped by
  `resume_from_checkpoint: auto`, and the resumed run equals an uninterrupted one;
- a truncated `final/model.safetensors` is refused by `eval` with one paragraph;
- a disk that fills up during a save (a file-size limit in the ranks) stops the run with one
  message, printed once, and leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from longctx_cli.errors import UserError
from longctx_cli.integrity import MANIFEST, verify_files
from longctx_cli.train.checkpoint_files import list_checkpoints, resolve_resume
from tests.shown_outputs import assert_shown_message
from tests.train_helpers import (
    IN_A_RANK,
    assert_same_run,
    read_metrics,
    run_longctx,
    train,
    write_config,
    write_documents,
)

COMMON = {
    "sequence_parallel_degree": 2,
    "gradient_accumulation_steps": 1,
    "max_steps": 6,
    "save_steps": 3,
    "collective_timeout_s": 30,
}

# Test-only fault, loaded into every rank (and warm rank process) through PYTHONPATH: when
# the save into a folder named by LONGCTX_TEST_FSIZE_AT starts, files may no longer grow
# beyond 4 KiB, as on a full disk. SIGXFSZ is ignored so that the write fails with EFBIG
# instead of killing the rank.
FULL_DISK = f"""
import os, sys
_at = os.environ.get("LONGCTX_TEST_FSIZE_AT")
if _at and {IN_A_RANK}:
    import resource, signal
    import torch.distributed.checkpoint as _dcp
    _save = _dcp.save
    def _limited_save(state, *args, checkpoint_id=None, **kwargs):
        if _at in str(checkpoint_id):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return _save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
    _dcp.save = _limited_save
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(work dir, data file, an uninterrupted run with checkpoint-3 and checkpoint-6)."""
    path = tmp_path_factory.mktemp("faults")
    data = write_documents(path / "docs.jsonl", seed=5)
    train(write_config(path, "straight", data, **COMMON), 2)
    return path, data, path / "straight"


def _truncate(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)


@pytest.mark.slow
def test_damaged_latest_checkpoint_is_skipped_and_resume_matches(straight):
    path, data, reference = straight
    run = path / "damaged"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("final"))
    assert [step for step, _ in list_checkpoints(run)] == [3, 6]
    assert verify_files(run / "checkpoint-6") == []
    shard = sorted((run / "checkpoint-6" / "state").glob("*.distcp"))[0]
    _truncate(shard)
    assert any(shard.name in p for p in verify_files(run / "checkpoint-6"))

    # An explicit path to the damaged checkpoint is refused, naming the file.
    with pytest.raises(UserError, match=shard.name):
        resolve_resume(str(run / "checkpoint-6"), run)
    assert resolve_resume("auto", run) == run / "checkpoint-3"

    result = train(write_config(path, "damaged", data, resume_from_checkpoint="auto", **COMMON), 2)
    out = result.stdout + result.stderr
    assert "checkpoint-6" in out and "damaged" in out and shard.name in out, out[-3000:]
    assert "at step 3" in out
    assert "Traceback" not in out
    assert_shown_message("damaged-checkpoint-skipped", out)
    assert_same_run(run, reference, tol=1e-6)
    assert verify_files(run / "checkpoint-6") == []  # rewritten whole by the resumed run


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(straight, tmp_path):
    _, _, reference = straight
    run = tmp_path / "all_damaged"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("final"))
    for _, checkpoint in list_checkpoints(run):
        _truncate(checkpoint / "scheduler.pt")
    with pytest.raises(UserError, match="every checkpoint"):
        resolve_resume("auto", run)


@pytest.mark.slow
def test_eval_refuses_a_truncated_final_model(straight, tmp_path):
    path, data, reference = straight
    final = tmp_path / "final"
    shutil.copytree(reference / "final", final)
    assert (final / MANIFEST).is_file()
    _truncate(final / "model.safetensors")
    # Long enough rows for the smallest passkey cell the byte tokenizer can hold.
    config = write_config(tmp_path, "eval", data, **{**COMMON, "sequence_len": 256},
                          eval_context_lengths=[256], eval_samples_per_cell=1)
    result = run_longctx("eval", str(config), "--checkpoint", str(final), timeout=120)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "is damaged: model.safetensors is" in err, err[-2000:]
    assert err.count("error:") == 1
    assert_shown_message("damaged-final", result.stderr)

    # Without a manifest (a model from elsewhere), the broken file is still one paragraph,
    # reported once by the ranks through the launcher.
    (final / MANIFEST).unlink()
    result = run_longctx("eval", str(config), "--checkpoint", str(final), timeout=180)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "could not load the model" in err
    assert err.count("could not load the model") == 1, err[-3000:]
    assert "rank " in err


def test_disk_full_during_save_stops_cleanly_and_keeps_the_previous_checkpoint(straight):
    path, data, reference = straight
    fault_dir = path / "full_disk_fault"
    fault_dir.mkdir()
    (fault_dir / "sitecustomize.py").write_text(FULL_DISK)
    config = write_config(path, "full", data, **COMMON)
    run = path / "full"
    env = {"PYTHONPATH": f"{fault_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "LONGCTX_TEST_FSIZE_AT": "checkpoint-6"}
    result = run_longctx("train", str(config), "--nproc-per-node", "2", env=env)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert err.count("could not write checkpoint-6") == 1, err[-3000:]
    assert "File too large" in err and "checkpoint-3" in err and "intact" in err
    assert_shown_message("disk-full", result.stderr)
    assert "rank " in err

    # Nothing saved before was harmed, and nothing half-written was left behind.
    assert [step for step, _ in list_checkpoints(run)] == [3]
    assert verify_files(run / "checkpoint-3") == []
    assert not (run / "checkpoint-6.tmp").exists()
    assert not (run / "final").exists()
    assert len(read_metrics(run)) == 6

    # The documented recovery: free space, resume.
    resumed = write_config(path, "full", data, resume_from_checkpoint="auto", **COMMON)
    train(resumed, 2)
    assert_same_run(run, reference, tol=1e-6)

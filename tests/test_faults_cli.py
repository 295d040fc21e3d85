"""Bad input around the config: one paragraph, exit status 2, no traceback, before any rank
starts (output_dir, dataset files, eval data, LoRA targets, an unreachable hub), and an
error raised on several ranks printed once."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app
from tests.train_helpers import TINY_LLAMA, run_longctx, write_config, write_documents

runner = CliRunner()


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def data(tmp_path) -> Path:
    return write_documents(tmp_path / "docs.jsonl", count=8)


def validate(config: Path) -> tuple[int, str]:
    result = runner.invoke(app, ["validate", str(config), "--nproc-per-node", "1"])
    assert "Traceback" not in result.output
    return result.exit_code, flat(result.output)


def test_output_dir_that_is_a_file(tmp_path, data):
    target = tmp_path / "results"
    target.write_text("not a folder")
    config = write_config(tmp_path, "run", data, output_dir=str(target))
    code, out = validate(config)
    assert code == 2 and "is an existing file, not a folder" in out, out
    # train stops before building data or starting ranks, with the same paragraph, once.
    result = run_longctx("train", str(config), "--nproc-per-node", "1", timeout=120)
    err = flat(result.stderr)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert err.count("is an existing file") == 1 and "resume" not in err
    assert target.read_text() == "not a folder"


def test_output_dir_under_a_file(tmp_path, data):
    (tmp_path / "results").write_text("x")
    config = write_config(tmp_path, "run", data, output_dir=str(tmp_path / "results" / "a"))
    code, out = validate(config)
    assert code == 2 and "is a file, not a folder" in out, out


def test_output_dir_on_a_read_only_file_system(tmp_path, data):
    """A real read-only mount (a tmpfs mounted `ro` in a private mount namespace): root
    ignores permission bits, so chmod could not simulate it."""
    mount = tmp_path / "ro"
    mount.mkdir()
    config = write_config(tmp_path, "run", data, output_dir=str(mount / "out"))
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o ro,size=1m none {mount}"],
                           capture_output=True, timeout=30)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip("cannot mount a read-only file system here (needs CAP_SYS_ADMIN)")
    command = (f"mount -t tmpfs -o ro,size=1m none {mount} && "
               f"exec {sys.executable} -m longctx_cli validate {config}")
    result = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    err = flat(result.stderr)
    assert result.returncode == 2, err[-2000:]
    assert "Traceback" not in result.stderr
    assert "cannot be written" in err and "Read-only file system" in err, err[-2000:]


def test_validate_checks_dataset_files(tmp_path, data):
    missing = write_config(tmp_path, "a", tmp_path / "nope.jsonl")
    code, out = validate(missing)
    assert code == 2 and "nope.jsonl' does not exist" in out, out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    code, out = validate(write_config(tmp_path, "b", empty))
    assert code == 2 and "empty.jsonl' is empty" in out, out
    code, out = validate(write_config(tmp_path, "c", data))
    assert code == 0 and "valid" in out, out


def test_validate_requires_eval_data_for_eval_steps(tmp_path, data):
    code, out = validate(write_config(tmp_path, "a", data, eval_steps=2, val_set_size=0))
    assert code == 2 and "eval_steps" in out and "no eval data" in out, out


def test_validate_checks_lora_targets_against_the_model(tmp_path, data):
    config = write_config(tmp_path, "a", data, adapter="lora",
                          lora_target_modules=["q_proj", "qkv_proj"])
    code, out = validate(config)
    assert code == 2 and "'qkv_proj'" in out and "q_proj, up_proj, v_proj" in out, out
    regex = write_config(tmp_path, "b", data, adapter="lora", lora_target_modules=".*\\.nope")
    assert validate(regex)[0] == 2
    fine = write_config(tmp_path, "c", data, adapter="lora", lora_target_modules=["v_proj"])
    assert validate(fine)[0] == 0


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"},
                                 {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_unreachable_hub_fails_in_seconds_naming_what_to_download(tmp_path, data, env):
    env = {**env, "HF_HOME": str(tmp_path / "hf_home"), "COLUMNS": "300"}
    tokenizer = write_config(tmp_path, "t", data, tokenizer="someorg/no-such-tokenizer")
    dataset = tmp_path / "d.yaml"
    dataset.write_text(yaml.safe_dump({"model_config": TINY_LLAMA, "tokenizer": "byte",
                                       "datasets": [{"path": "someorg/no-such-dataset"}],
                                       "output_dir": str(tmp_path / "out")}))
    for config, name in ((tokenizer, "someorg/no-such-tokenizer"),
                         (dataset, "someorg/no-such-dataset")):
        started = time.monotonic()
        result = run_longctx("preprocess", str(config), env=env, timeout=120)
        assert time.monotonic() - started < 45  # imports included, on a loaded machine
        err = flat(result.stderr)
        assert result.returncode == 2 and "Traceback" not in result.stderr, err[-2000:]
        assert err.count("cannot load the") == 1 and name in err, err[-2000:]
        assert "hub is unreachable" in err and f"hf download {name}" in err


def test_the_first_rank_error_is_shown_once_with_its_rank(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from longctx_cli.launcher.launch import describe_failure, failure_exit_code

    def failure(rank: int, message: str | None, at: float, code: int = 2) -> ProcessFailure:
        path = tmp_path / f"error-{rank}.json"
        if message is not None:
            path.write_text(json.dumps({"message": message, "timestamp": int(at),
                                        "longctx": {"user_error": True, "time": at}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                              error_file=str(path))

    now = time.time()
    failures = {0: failure(0, "output_dir: disk full (rank 0)", now + 0.5),
                1: failure(1, "output_dir: disk full (rank 1)", now),
                2: failure(2, None, now, code=-signal.SIGTERM)}
    line = describe_failure(failures)
    assert line == "rank 1: output_dir: disk full (rank 1)"
    assert failure_exit_code(failures) == 2


def test_a_rank_error_prints_only_longctx_paragraph(tmp_path):
    """A UserError raised on the ranks (here: too little data for one optimizer step, known
    only once the rows are built) ends the run with the rank's paragraph, once, and none of
    torchelastic's own log lines about the failed child or its error file."""
    data = write_documents(tmp_path / "docs.jsonl", count=40)
    config = write_config(tmp_path, "run", data, gradient_accumulation_steps=500,
                          val_set_size=0, eval_steps=None)
    result = run_longctx("train", str(config), "--nproc-per-node", "2", timeout=240)
    err = flat(result.stderr)
    assert result.returncode == 2 and "Traceback" not in result.stderr, err[-2000:]
    assert err.count("the training set has 15 packed rows") == 1, err[-2000:]
    # Every rank raises it; whichever reports first is named (rank 1 under load).
    assert re.search(r"error: rank \d: datasets:", err), err[-2000:]
    # ... nor the import-time warnings of torchao (its kernels for other hardware) and of
    # torch's pytree about torchao's enums, which every rank printed.
    for noise in ("no error file defined for parent", "error_handler", "failed (exitcode",
                  "child error file", "Failed to load", "_pytree"):
        assert noise not in err, err[-2000:]

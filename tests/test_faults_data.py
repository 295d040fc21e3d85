"""Data faults: an enormous record costs bounded time, configs sharing a cache folder keep
their own caches, and logs redirected to a file get no progress bars."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.prepare import prepare
from longctx_cli.errors import UserError

BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte", "sequence_len": 64}


def config(tmp_path: Path, data: Path, **kw):
    return config_from_dict({**BASE, "dataset_prepared_path": str(tmp_path / "prepared"),
                             "datasets": [{"path": str(data)}], **kw})


@pytest.fixture
def huge_line(tmp_path) -> Path:
    """Four normal records around one 20 MB line (the byte tokenizer, pure Python, would need
    minutes and gigabytes for it)."""
    f = tmp_path / "d.jsonl"
    with f.open("w") as fh:
        fh.write(json.dumps({"text": "short one"}) + "\n")
        fh.write(json.dumps({"text": "many words " * 2_000_000}) + "\n")
        for i in range(3):
            fh.write(json.dumps({"text": f"short {i}"}) + "\n")
    return f


def test_an_enormous_record_is_dropped_in_bounded_time(tmp_path, huge_line):
    started = time.monotonic()
    p = prepare(config(tmp_path, huge_line), progress=False)
    assert time.monotonic() - started < 30
    (stats,) = p.report.datasets
    assert (stats.records, stats.dropped, stats.samples) == (5, 1, 4)


def test_an_enormous_record_is_truncated_or_reported_with_its_line(tmp_path, huge_line):
    p = prepare(config(tmp_path, huge_line, excess_length_strategy="truncate"), progress=False)
    (stats,) = p.report.datasets
    assert (stats.truncated, stats.samples) == (1, 5)
    assert max(len(r) for r in p.train["input_ids"]) <= 64
    with pytest.raises(UserError, match=f"{huge_line}:2"):
        prepare(config(tmp_path, huge_line, excess_length_strategy="error"), progress=False)


@pytest.mark.parametrize("kind", ["alpaca", "chat_template"])
def test_an_enormous_structured_record_is_cut_keeping_its_shape(tmp_path, kind):
    """The cut applies to the texts a format renders (roles and field names stay), so the
    record stays "too long" instead of turning into a malformed or empty one."""
    huge = "many words " * 2_000_000
    short = {"alpaca": {"instruction": "say hi", "input": "", "output": "hi"},
             "chat_template": {"messages": [{"role": "user", "content": "say hi"},
                                            {"role": "assistant", "content": "hi"}]}}[kind]
    long = {"alpaca": {"instruction": huge, "input": "x", "output": "y"},
            "chat_template": {"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": huge},
                                           {"role": "user", "content": "again"},
                                           {"role": "assistant", "content": "z"}]}}[kind]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (short, long, short)))
    extra = {"chat_template": "chatml"} if kind == "chat_template" else {}
    cfg = config_from_dict({**BASE, **extra, "sequence_len": 512,
                            "dataset_prepared_path": str(tmp_path / "p"),
                            "datasets": [{"path": str(f), "type": kind}]})
    started = time.monotonic()
    (stats,) = prepare(cfg, progress=False).report.datasets
    assert time.monotonic() - started < 30
    assert (stats.records, stats.dropped, stats.skipped, stats.samples) == (3, 1, 0, 2)


def test_configs_sharing_a_prepared_path_keep_each_others_cache(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "word " * i}) + "\n" for i in range(1, 12)))
    a, b = config(tmp_path, data), config(tmp_path, data, sequence_len=48)
    first_a = prepare(a, progress=False)
    first_b = prepare(b, progress=False)
    assert not first_b.reused and "sequence_len" in first_b.report.reason
    assert first_a.path != first_b.path
    again_a, again_b = prepare(a, progress=False), prepare(b, progress=False)
    assert again_a.reused and again_b.reused
    assert again_a.train.to_dict() == first_a.train.to_dict()


_PREPROCESS = [sys.executable, "-m", "longctx_cli", "preprocess"]


def _data_config(tmp_path: Path) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} " * 5}) + "\n" for i in range(50)))
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({**BASE, "datasets": [{"path": str(data)}],
                                "output_dir": str(tmp_path / "out")}))
    return path


def test_no_progress_bars_when_output_goes_to_a_file(tmp_path):
    log = tmp_path / "log.txt"
    with log.open("w") as fh:
        subprocess.run([*_PREPROCESS, str(_data_config(tmp_path))], stdout=fh,
                       stderr=subprocess.STDOUT, check=True, timeout=120,
                       env={**os.environ, "COLUMNS": "120"})
    text = log.read_text()
    assert "\r" not in text and "it/s" not in text and "examples/s" not in text, text[-2000:]
    assert "Tokenizing" in text  # a plain line says what is being done instead
    assert "Built cache" in text


def test_progress_bars_on_a_terminal(tmp_path):
    """The same command on a pseudo-terminal draws bars (carriage returns; on data this small
    they finish and are cleared at once) and no plain progress lines."""
    config_path = _data_config(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdout and stderr are the terminal
        os.execvpe(_PREPROCESS[0], [*_PREPROCESS, str(config_path)], dict(os.environ))
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text and "Built cache" in text, text[-2000:]
    assert "records\r\n" not in text and "Packing" not in text, text[-2000:]

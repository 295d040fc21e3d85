"""Each dataset format trains at sp=2 on CPU from a local file in the shape users have, and a
streamed `pretraining_dataset` resumes exactly where it stopped."""

from __future__ import annotations

import json
import math

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.stream import PackedStream
from longctx_cli.data.tokenizer import byte_tokenizer
from tests.train_helpers import assert_same_run, read_metrics, train, write_config

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def words(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# (file name, records, dataset entry, extra top-level keys)
FORMATS = {
    "alpaca": ("alpaca.jsonl",
               [{"instruction": words(i, 3), "input": words(i, 2) if i % 2 else "",
                 "output": words(i + 1, 4)} for i in range(32)],
               {"type": "alpaca"}, {}),
    "sharegpt": ("sharegpt.jsonl",
                 [{"conversations": [{"from": "human", "value": words(i, 3)},
                                     {"from": "gpt", "value": words(i + 2, 5)}]}
                  for i in range(32)],
                 {"type": "chat_template", "field_messages": "conversations",
                  "message_property_mappings": {"role": "from", "content": "value"}},
                 {"chat_template": "chatml"}),
    "input_output": ("io.jsonl",
                     [{"segments": [{"label": False, "text": words(i, 3) + "\n"},
                                    {"label": True, "text": words(i + 3, 4)}]}
                      for i in range(32)],
                     {"type": "input_output"}, {}),
    "completion": ("c.jsonl", [{"body": words(i, 8)} for i in range(32)],
                   {"type": "completion", "field": "body"}, {}),
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ("alpaca", "input_output", "completion")
    else n
    for n in sorted(FORMATS)])
def test_format_trains_two_steps_at_sp2(tmp_path, name):
    file_name, records, entry, top = FORMATS[name]
    data = write_jsonl(tmp_path / file_name, records)
    config = write_config(
        tmp_path, name, data, datasets=[{"path": str(data), **entry}], sequence_len=512,
        sequence_parallel_degree=2, gradient_accumulation_steps=1, max_steps=2,
        val_set_size=0, eval_steps=None, **top)
    train(config, 2)
    metrics = read_metrics(tmp_path / name)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["tokens"] > 0 and math.isfinite(m["loss"]) for m in metrics)


@pytest.mark.slow  # the suite's time; the other formats train at sp 2 by default above
def test_pretrain_csv_with_text_column_trains_at_sp2(tmp_path):
    data = tmp_path / "corpus.csv"
    data.write_text("id,content\n" + "".join(f"{i},{words(i, 12)}\n" for i in range(20)))
    config = write_config(
        tmp_path, "pretrain", data,
        datasets=[{"path": str(data), "type": "pretrain", "text_column": "content"}],
        sequence_len=64, sequence_parallel_degree=2, gradient_accumulation_steps=1,
        max_steps=2, val_set_size=0, eval_steps=None)
    train(config, 2)
    assert [m["step"] for m in read_metrics(tmp_path / "pretrain")] == [1, 2]


# ---- streaming ----------------------------------------------------------------------------


def _stream_files(tmp_path):
    a = write_jsonl(tmp_path / "s1.jsonl", [{"text": words(i, 3 + i % 9)} for i in range(9)])
    b = write_jsonl(tmp_path / "s2.jsonl", [{"text": words(i, 20)} for i in range(3)]
                    + [{"text": ""}])
    return a, b


def _stream_config(tmp_path, a, b, **kw):
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte", "sequence_len": 48,
        "max_steps": 10, "streaming": True, **kw,
        "pretraining_dataset": [{"path": str(a)}, {"path": str(b), "text_column": "text"}]})


def test_stream_rows_resume_from_the_saved_position(tmp_path):
    a, b = _stream_files(tmp_path)
    config = _stream_config(tmp_path, a, b)
    tok = byte_tokenizer()
    straight = PackedStream(config, tok)
    rows = straight.next_rows(30)  # several passes over both files
    assert straight.state["pass"] >= 2
    assert all(len(r["input_ids"]) == 48 for r in rows)
    # The stream is every document + eos, in file order, cut into rows without loss.
    docs = [words(i, 3 + i % 9) + "</s>" for i in range(9)] + [words(i, 20) + "</s>"
                                                                for i in range(3)]
    text = tok.decode([t for r in rows for t in r["input_ids"]])
    assert text.startswith("".join(docs) + "".join(docs))
    for stop in (1, 4, 13):
        first = PackedStream(config, tok)
        first.next_rows(stop)
        saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        resumed = PackedStream(config, tok)
        resumed.load_state_dict(saved)
        assert resumed.next_rows(30 - stop) == rows[stop:]
        # The saved position is a place in the files (pass, entry, record), not a row count
        # to skip by reading the stream again from its start.
        assert (saved["pass"], saved["entry"], saved["records"]) != (0, 0, 0)
        assert saved["stream"] is not None or saved["records"] == 0


@pytest.mark.slow
def test_streamed_run_resumed_equals_uninterrupted_run(tmp_path):
    a, b = _stream_files(tmp_path)
    common = {"datasets": [], "pretraining_dataset": [{"path": str(a)}, {"path": str(b)}],
              "streaming": True, "sequence_len": 48, "sequence_parallel_degree": 2,
              "gradient_accumulation_steps": 2, "save_steps": 3, "val_set_size": 0,
              "eval_steps": None}
    straight = write_config(tmp_path, "straight", a, max_steps=6, **common)
    train(straight, 2)
    first_half = write_config(tmp_path, "resumed", a, max_steps=3, **common)
    train(first_half, 2)
    state = json.loads((tmp_path / "resumed" / "checkpoint-3" / "trainer_state.json")
                       .read_text())
    assert state["data"]["stream"]["rows"] == 3 * 2
    second_half = write_config(tmp_path, "resumed", a, max_steps=6,
                               resume_from_checkpoint="auto", **common)
    result = train(second_half, 2)
    assert "resumed from" in result.stdout + result.stderr
    assert_same_run(tmp_path / "resumed", tmp_path / "straight", tol=1e-6)

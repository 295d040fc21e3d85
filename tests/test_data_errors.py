"""Every bad input is one UserError naming the file / line / field, and leaves the cache alone."""

from __future__ import annotations

import json

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.prepare import prepare
from longctx_cli.errors import UserError


def config(tmp_path, datasets, **kw):
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"), "datasets": datasets, **kw})


def error_of(tmp_path, datasets, **kw) -> str:
    with pytest.raises(UserError) as err:
        prepare(config(tmp_path, datasets, **kw), progress=False)
    message = str(err.value)
    assert "\n" not in message.strip() and "Traceback" not in message
    assert not (tmp_path / "prepared").exists()  # nothing half-written is left behind
    assert not list(tmp_path.glob("**/.*.tmp-*"))
    return message


def test_invalid_json_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n\n{"text": "bad",}\n', encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f)}])
    assert f"{f}:3" in msg and "invalid JSON" in msg


def test_json_line_that_is_not_an_object(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n[1, 2]\n', encoding="utf-8")
    assert f"{f}:2" in error_of(tmp_path, [{"path": str(f)}])


def test_missing_field_lists_the_fields_that_exist(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"content": "a", "id": 1}\n', encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f), "field": "text"}])
    assert str(f) in msg and "'text'" in msg and "content, id" in msg and "`field:`" in msg


def test_missing_messages_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"conversation": []}\n', encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f), "type": "chat_template"}])
    assert "'messages'" in msg and "conversation" in msg and "messages_field" in msg


def test_empty_dataset(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n", encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f)}])
    assert str(f) in msg and "empty" in msg


def test_all_samples_dropped_is_explained(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "x" * 100}) + "\n", encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f)}], sequence_len=16)
    assert "no train samples" in msg and "1 longer than sequence_len dropped" in msg


def test_non_utf8_file(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    msg = error_of(tmp_path, [{"path": str(f)}])
    assert f"{f}:2" in msg and "UTF-8" in msg and "0xe9" in msg


def test_non_utf8_text_file(tmp_path):
    f = tmp_path / "d.txt"
    f.write_bytes(b"line one\nline \xff two\n")
    assert f"{f}:2" in error_of(tmp_path, [{"path": str(f), "type": "pretrain"}])


def test_unknown_chat_role(tmp_path):
    f = tmp_path / "c.jsonl"
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    f.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": bad}) + "\n",
                 encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f), "type": "chat_template"}])
    assert f"{f}:2" in msg and "'robot'" in msg and "assistant" in msg


def test_missing_file(tmp_path):
    msg = error_of(tmp_path, [{"path": str(tmp_path / "nope.jsonl")}])
    assert "nope.jsonl" in msg and "does not exist" in msg


def test_wrong_field_type(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    g = tmp_path / "n.jsonl"
    g.write_text('{"text": 5}\n', encoding="utf-8")
    msg = error_of(tmp_path, [{"path": str(f)}, {"path": str(g)}])
    assert f"{g}:1" in msg and "string" in msg


def test_no_datasets(tmp_path):
    assert "datasets" in error_of(tmp_path, [])


def test_prepared_path_that_is_not_a_cache_is_never_overwritten(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n', encoding="utf-8")
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="not a longctx data cache"):
        prepare(config(tmp_path, [{"path": str(f)}]), progress=False)
    assert (tmp_path / "prepared" / "thesis.tex").read_text() == "precious"


def test_bad_input_never_damages_an_existing_cache(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n', encoding="utf-8")
    good = prepare(config(tmp_path, [{"path": str(f)}]), progress=False)
    before = sorted(p.name for p in (tmp_path / "prepared").iterdir())
    f.write_text('{"text": "a"}\n{oops\n', encoding="utf-8")
    with pytest.raises(UserError, match=":2"):
        prepare(config(tmp_path, [{"path": str(f)}]), progress=False)
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == before
    f.write_text('{"text": "a"}\n', encoding="utf-8")
    again = prepare(config(tmp_path, [{"path": str(f)}]), progress=False)
    assert again.reused and again.train.to_dict() == good.train.to_dict()

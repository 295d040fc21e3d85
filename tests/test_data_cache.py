"""The prepared-data cache: fingerprint, reuse, rebuild, and atomic replacement."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data import pack
from longctx_cli.data.prepare import compute_fingerprint, prepare
from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.durable import COMPLETE_MARKER as MARKER

BASE = {"model_config": {"model_type": "llama"}, "tokenizer": "byte", "sequence_len": 64}


def config(tmp_path, path, **kw):
    return config_from_dict({**BASE, "dataset_prepared_path": str(tmp_path / "prepared"),
                             "datasets": [{"path": str(path)}], **kw})


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": "word " * i}) + "\n" for i in range(1, 12)))
    return f


def test_every_input_changes_the_fingerprint(tmp_path, data):
    tok = byte_tokenizer()
    base = compute_fingerprint(config(tmp_path, data), tok)
    assert compute_fingerprint(config(tmp_path, data), byte_tokenizer()) == base
    # The output location and the worker count do not change what is built.
    assert compute_fingerprint(config(tmp_path / "x", data, num_proc=3), tok) == base
    variants = {
        "sequence_len": config(tmp_path, data, sequence_len=65),
        "packing": config(tmp_path, data, sample_packing=False),
        "excess": config(tmp_path, data, excess_length_strategy="truncate"),
        "seed": config(tmp_path, data, seed=7),
        "val": config(tmp_path, data, val_set_size=0.1),
        "field": config_from_dict({**BASE, "datasets": [{"path": str(data), "field": "t"}]}),
        "type": config_from_dict({**BASE, "datasets": [{"path": str(data), "type": "pretrain"}]}),
    }
    prints = {name: compute_fingerprint(c, tok) for name, c in variants.items()}
    other_tok = byte_tokenizer()
    other_tok.chat_template = "{{ messages[0]['content'] }}"
    prints["tokenizer"] = compute_fingerprint(config(tmp_path, data), other_tok)
    data.write_text(data.read_text() + json.dumps({"text": "one more"}) + "\n")
    prints["content"] = compute_fingerprint(config(tmp_path, data), tok)
    assert len(set(prints.values()) | {base}) == len(prints) + 1, prints


def test_second_run_reuses_and_a_change_rebuilds_saying_why(tmp_path, data):
    first = prepare(config(tmp_path, data), progress=False)
    assert not first.reused and first.report.reason == "no cache yet"
    again = prepare(config(tmp_path, data), progress=False)
    assert again.reused and again.report.reused
    assert again.train.to_dict() == first.train.to_dict()
    assert "Reused cache" in str(again.report) and again.report.train == first.report.train
    changed = prepare(config(tmp_path, data, sequence_len=80), progress=False)
    assert not changed.reused and "sequence_len" in changed.report.reason
    data.write_text(data.read_text() + json.dumps({"text": "new"}) + "\n")
    rebuilt = prepare(config(tmp_path, data, sequence_len=80), progress=False)
    assert "datasets[0].content" in rebuilt.report.reason
    forced = prepare(config(tmp_path, data, sequence_len=80), progress=False, force=True)
    assert not forced.reused and forced.report.reason == "rebuild forced"


def test_failure_mid_write_keeps_the_old_cache(tmp_path, data, monkeypatch):
    good = prepare(config(tmp_path, data), progress=False)
    files_before = {p: p.read_bytes() for p in (tmp_path / "prepared").rglob("*") if p.is_file()}
    calls = {"n": 0}
    real = pack.make_row

    def fail_on_third_row(samples):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-build
        return real(samples)

    monkeypatch.setattr(pack, "make_row", fail_on_third_row)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(tmp_path, data, sequence_len=48), progress=False)
    assert calls["n"] == 3
    after = {p: p.read_bytes() for p in (tmp_path / "prepared").rglob("*") if p.is_file()}
    assert after == files_before
    assert not list((tmp_path / "prepared").glob(".*"))  # the temporary folder is gone
    monkeypatch.undo()
    reused = prepare(config(tmp_path, data), progress=False)
    assert reused.reused and reused.train.to_dict() == good.train.to_dict()


def test_a_cache_without_its_marker_is_never_accepted(tmp_path, data):
    entry = Path(prepare(config(tmp_path, data), progress=False).path)
    os.remove(entry / MARKER)
    p = prepare(config(tmp_path, data), progress=False)
    assert not p.reused and "incomplete" in p.report.reason
    assert (entry / MARKER).is_file()


def test_a_damaged_cache_is_rebuilt(tmp_path, data):
    first = prepare(config(tmp_path, data), progress=False)
    rows = first.train.to_dict()
    for arrow in (Path(first.path) / "train").glob("*.arrow"):
        arrow.write_bytes(b"garbage")
    p = prepare(config(tmp_path, data), progress=False)
    assert not p.reused and "unreadable" in p.report.reason
    assert p.train.to_dict() == rows


def test_leftovers_of_a_killed_build_are_removed_and_ignored(tmp_path, data):
    fp = compute_fingerprint(config(tmp_path, data), byte_tokenizer())
    dead = tmp_path / "prepared" / f".{fp}.tmp-999999999-deadbeef"
    (dead / "train").mkdir(parents=True)
    (dead / MARKER).write_text("whatever")
    p = prepare(config(tmp_path, data), progress=False)
    assert not p.reused and not dead.exists()

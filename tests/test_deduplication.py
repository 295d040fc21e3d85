"""`dataset_exact_deduplication`: a record identical to an earlier one of its split (every
field, across the split's datasets) is dropped before tokenizing, and the preprocess report
counts it for its dataset."""

from __future__ import annotations

import json

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.prepare import prepare
from longctx_cli.data.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


def _config(tmp_path, dedup: bool, **top):
    for name, texts in (("a", ["one", "two", "one", "three"]), ("b", ["two", "four"])):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t, "source": "s"}) + "\n" for t in texts))
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte", "sequence_len": 64,
        "dataset_prepared_path": str(tmp_path / ("dedup" if dedup else "all")),
        "dataset_exact_deduplication": dedup,
        "datasets": [{"path": str(tmp_path / "a.jsonl"), "type": "completion"},
                     {"path": str(tmp_path / "b.jsonl"), "type": "completion"}], **top})


def _headers(report) -> list[str]:
    return [str(c.header) for c in report._datasets_table().columns]


def _documents(prepared) -> list[str]:
    out = []
    for row in prepared.train:
        pos = row["position_ids"]
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        out += [TOK.decode(row["input_ids"][s:e]).replace("</s>", "").replace("<pad>", "")
                for s, e in zip(starts, starts[1:], strict=False) if e > s]
    return sorted(d for d in out if d)


def test_duplicates_are_dropped_and_counted(tmp_path):
    kept = prepare(_config(tmp_path, True), progress=False)
    assert _documents(kept) == ["four", "one", "three", "two"]
    a, b = kept.report.datasets
    assert (a.records, a.duplicates, a.samples) == (4, 1, 3)
    assert (b.records, b.duplicates, b.samples) == (2, 1, 1)  # "two" came in a.jsonl
    assert "duplicates" in _headers(kept.report) and "1 dropped" in str(kept.report)
    everything = prepare(_config(tmp_path, False), progress=False)
    assert _documents(everything) == ["four", "one", "one", "three", "two", "two"]
    assert all(d.duplicates == 0 for d in everything.report.datasets)
    assert "duplicates" not in _headers(everything.report)  # the report is as before when off


def test_refused_for_a_streamed_dataset(tmp_path):
    with pytest.raises(Exception, match="dataset_exact_deduplication` cannot compare"):
        config_from_dict({
            "model_config": {"model_type": "llama"}, "tokenizer": "byte", "max_steps": 2,
            "dataset_exact_deduplication": True,
            "pretraining_dataset": [{"path": str(tmp_path / "a.jsonl"), "type": "pretrain"}]})

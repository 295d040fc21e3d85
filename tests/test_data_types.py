"""Each dataset type through `prepare`, on files the tests write."""

from __future__ import annotations

import json

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.prepare import prepare
from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.errors import UserError

TOK = byte_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def config(tmp_path, datasets, **kw):
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"), "datasets": datasets, **kw})


def check_rows(ds, sequence_len):
    for row in ds:
        n = len(row["input_ids"])
        assert 0 < n <= sequence_len
        assert len(row["labels"]) == len(row["position_ids"]) == n
        for t, p in enumerate(row["position_ids"]):
            if p == 0:
                assert row["labels"][t] == -100
            else:
                assert row["position_ids"][t - 1] == p - 1


def docs_of(row):
    """Split a row into its documents' token lists (by position_ids restarting)."""
    docs = []
    for tok_id, p in zip(row["input_ids"], row["position_ids"], strict=True):
        if p == 0:
            docs.append([])
        docs[-1].append(tok_id)
    return docs


def test_completion_packs_every_document_with_eos(tmp_path):
    texts = [f"document number {i} " * (i + 1) for i in range(12)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts] + [{"text": ""}])
    p = prepare(config(tmp_path, [{"path": path}], sequence_len=256), progress=False)
    check_rows(p.train, 256)
    got = sorted(TOK.decode(d) for row in p.train for d in docs_of(row))
    assert got == sorted(t + "</s>" for t in texts)
    (stats,) = p.report.datasets
    assert (stats.records, stats.skipped, stats.samples) == (13, 1, 12)
    assert p.report.train.tokens == sum(len(t.encode()) + 1 for t in texts)
    assert p.report.train.rows < 12 and p.report.train.efficiency > 0.5
    assert p.eval is None and not p.reused
    assert "Sample length" in str(p.report) and "Built cache" in str(p.report)


def test_without_packing_one_sample_per_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": f"t{i}"} for i in range(5)])
    cfg = config(tmp_path, [{"path": path, "field": "body"}], sample_packing=False)
    p = prepare(cfg, progress=False)
    assert sorted(TOK.decode(r["input_ids"]) for r in p.train) == [f"t{i}</s>" for i in range(5)]
    assert all(r["labels"][0] == -100 and r["labels"][1:] == r["input_ids"][1:]
               for r in p.train)


@pytest.mark.parametrize("strategy", ["drop", "truncate", "error"])
def test_excess_length_strategies(tmp_path, strategy):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a" * 10}, {"text": "b" * 100},
                                              {"text": "c" * 5}])
    cfg = config(tmp_path, [{"path": path}], sequence_len=32, excess_length_strategy=strategy)
    if strategy == "error":
        with pytest.raises(UserError) as err:
            prepare(cfg, progress=False)
        assert f"{path}:2" in str(err.value) and "sequence_len" in str(err.value)
        return
    p = prepare(cfg, progress=False)
    (stats,) = p.report.datasets
    assert stats.too_long == 1
    texts = sorted(TOK.decode(d) for row in p.train for d in docs_of(row))
    if strategy == "drop":
        assert stats.dropped == 1 and texts == ["a" * 10 + "</s>", "c" * 5 + "</s>"]
    else:
        assert stats.truncated == 1 and "b" * 32 in texts
    assert p.report.length_histogram[-1] == (33, -1, 1)  # the overflow bucket
    check_rows(p.train, 32)


def test_chat_template_trains_only_on_replies(tmp_path):
    convs = [
        [{"role": "user", "content": f"question {i}"},
         {"role": "assistant", "content": f"answer {i}"}] for i in range(4)
    ] + [[{"role": "user", "content": "no reply"}]]
    path = write_jsonl(tmp_path / "c.jsonl", [{"conv": c} for c in convs])
    cfg = config(tmp_path, [{"path": path, "type": "chat_template", "messages_field": "conv"}])
    p = prepare(cfg, progress=False)
    check_rows(p.train, 4096)
    targets = [TOK.decode([t for t in r["labels"] if t != -100]) for r in p.train]
    assert sorted("".join(targets).split("</s>")[:-1]) == [f"answer {i}" for i in range(4)]
    assert p.report.datasets[0].skipped == 1
    assert p.report.datasets[0].skip_reason == "no target tokens"


def test_pretrain_concatenates_and_cuts(tmp_path):
    texts = ["x" * 50, "y" * 30, "z" * 70]
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    cfg = config(tmp_path, [{"path": str(tmp_path / "t.txt"), "type": "pretrain"}],
                 sequence_len=64, sample_packing=False)
    p = prepare(cfg, progress=False)
    rows = [r["input_ids"] for r in p.train]
    assert sorted(len(r) for r in rows) == [25, 64, 64]  # 51 + 31 + 71 = 153 tokens
    first = next(r for r in rows if TOK.decode(r[:1]) == "x")
    middle = next(r for r in rows if len(r) == 64 and r is not first)
    last = next(r for r in rows if len(r) == 25)
    assert TOK.decode(first + middle + last) == "</s>".join(texts) + "</s>"
    # The piece continuing "z" restarts its positions: to the trainer it is a new document.
    assert [r["position_ids"][0] for r in p.train] == [0, 0, 0]
    assert p.report.train.tokens == 153
    check_rows(p.train, 64)


def test_passkey_eval_datasets_and_val_split(tmp_path):
    entry = {"type": "passkey", "num_samples": 20, "context_lengths": [300, 400]}
    p = prepare(config(tmp_path, [entry], sequence_len=512, val_set_size=0.25), progress=False)
    assert p.eval is not None and len(p.eval) == round(0.25 * (len(p.train) + len(p.eval)))
    check_rows(p.train, 512)
    assert p.report.train.tokens + p.report.eval.tokens == 10 * 300 + 10 * 400
    p2 = prepare(config(tmp_path / "b", [entry], sequence_len=512,
                        eval_datasets=[{**entry, "num_samples": 3, "seed": 5}]), progress=False)
    assert p2.report.eval.tokens == 300 + 400 + 300
    assert p2.report.train.tokens == 7000


def test_parquet_folder_and_json_array(tmp_path):
    import datasets

    folder = tmp_path / "pq"
    folder.mkdir()
    datasets.Dataset.from_dict({"text": ["alpha", "beta"]}).to_parquet(str(folder / "a.parquet"))
    datasets.Dataset.from_dict({"text": ["gamma"]}).to_parquet(str(folder / "b.parquet"))
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"text": "delta"}]), encoding="utf-8")
    p = prepare(config(tmp_path, [{"path": str(folder)}, {"path": str(arr)}]), progress=False)
    got = sorted(TOK.decode(d) for row in p.train for d in docs_of(row))
    assert got == ["alpha</s>", "beta</s>", "delta</s>", "gamma</s>"]


def test_rows_are_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "w" * (i * 7 % 40 + 1)}
                                              for i in range(40)])
    a = prepare(config(tmp_path / "a", [{"path": path}], sequence_len=64), progress=False)
    b = prepare(config(tmp_path / "b", [{"path": path}], sequence_len=64), progress=False)
    assert a.train.to_dict() == b.train.to_dict()

"""Axolotl's dataset formats, token by token, with the byte tokenizer (one token per byte,
eos = 1), so every expected id and label is written down from the text it stands for."""

from __future__ import annotations

import json

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data import formats
from longctx_cli.data.prepare import format_spec, prepare
from longctx_cli.data.tokenizer import byte_tokenizer
from longctx_cli.errors import UserError

TOK = byte_tokenizer()
EOS = 1
IGN = -100


def enc(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def expected(pieces: list[tuple[str | int, bool]]) -> tuple[list[int], list[int]]:
    """ids and labels from (text or token id, is_target) pieces."""
    ids: list[int] = []
    labels: list[int] = []
    for piece, target in pieces:
        part = [piece] if isinstance(piece, int) else enc(piece)
        ids += part
        labels += part if target else [IGN] * len(part)
    return ids, labels


def cfg(tmp_path, entry: dict, **top):
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(tmp_path / "d.jsonl"), **entry}], **top})


def tokenize(tmp_path, records: list[dict], entry: dict, **top) -> dict[str, list]:
    """One record per sample, through the same function `prepare` maps over the data."""
    config = cfg(tmp_path, entry, **top)
    spec = format_spec(config.data.datasets[0], config, TOK)
    batch = {k: [r.get(k) for r in records] for k in {k for r in records for k in r}}
    return formats.tokenize_batch(batch, list(range(len(records))), spec=spec, tok=TOK,
                                  where=lambda i: f"d.jsonl:{i + 1}")


def one(out: dict[str, list], n: int = 0) -> tuple[list[int], list[int]]:
    return out["input_ids"][n], out["labels"][n]


# ---- alpaca -----------------------------------------------------------------------------

NO_INPUT_SYSTEM = ("Below is an instruction that describes a task. Write a response that "
                   "appropriately completes the request.")
INPUT_SYSTEM = ("Below is an instruction that describes a task, paired with an input that "
                "provides further context. Write a response that appropriately completes "
                "the request.")


def test_alpaca_with_and_without_input(tmp_path):
    records = [{"instruction": "Add", "input": "2 and 3", "output": "5"},
               {"instruction": "Say hi", "input": "", "output": "hi"}]
    out = tokenize(tmp_path, records, {"type": "alpaca"})
    assert one(out, 0) == expected([
        (INPUT_SYSTEM + "\n\n### Instruction:\nAdd\n\n### Input:\n2 and 3\n\n### Response:\n",
         False), ("5", True), (EOS, True)])
    assert one(out, 1) == expected([
        (NO_INPUT_SYSTEM + "\n\n### Instruction:\nSay hi\n\n### Response:\n", False),
        ("hi", True), (EOS, True)])


def test_alpaca_train_on_inputs_and_variants(tmp_path):
    rec = [{"instruction": "Q", "output": "A", "system": "Be brief."}]
    ids, labels = one(tokenize(tmp_path, rec, {"type": "alpaca"}, train_on_inputs=True))
    assert labels == ids  # every token, the prompt included
    assert one(tokenize(tmp_path, rec, {"type": "alpaca_w_system.load_instruct"})) == expected(
        [("Be brief.\n\n### Instruction:\nQ\n\n### Response:\n", False), ("A", True),
         (EOS, True)])
    assert one(tokenize(tmp_path, rec, {"type": "alpaca_w_system.load_chat"})) == expected(
        [("SYSTEM: Be brief.\nUSER: Q\nASSISTANT:", False), ("A", True), (EOS, True)])
    assert one(tokenize(tmp_path, rec, {"type": "alpaca:chatml"})) == expected([
        ("<|im_start|>system\n" + NO_INPUT_SYSTEM + "<|im_end|>\n<|im_start|>user\nQ"
         "<|im_end|>\n<|im_start|>assistant\n", False), ("A", True), (EOS, True)])
    assert one(tokenize(tmp_path, rec, {"type": "alpaca_instruct.load_no_prompt"})) == expected(
        [("### Instruction:\nQ\n\n### Response:\n", False), ("A", True), (EOS, True)])


def test_alpaca_malformed_records(tmp_path):
    out = tokenize(tmp_path, [{"instruction": "Q", "output": " "}], {"type": "alpaca"})
    assert out["skip"] == ["empty output"] and out["input_ids"] == [[]]
    with pytest.raises(UserError) as err:
        tokenize(tmp_path, [{"instruction": "Q", "output": "A"}, {"instruction": "Q"}],
                 {"type": "alpaca"})
    assert "d.jsonl:2" in str(err.value) and "`output`" in str(err.value)
    with pytest.raises(UserError) as err:
        tokenize(tmp_path, [{"instruction": 3, "output": "A"}], {"type": "alpaca"})
    assert "d.jsonl:1" in str(err.value) and "string" in str(err.value)


# ---- chat_template ----------------------------------------------------------------------

SHAREGPT = {"type": "chat_template", "field_messages": "conversations",
            "message_property_mappings": {"role": "from", "content": "value"}}


def sharegpt(*turns: tuple[str, str], **extra) -> dict:
    return {"conversations": [{"from": f, "value": v, **extra} for f, v in turns]}


def chatml(role: str) -> str:
    return f"<|im_start|>{role}\n"


def test_sharegpt_mappings_and_roles_with_chatml(tmp_path):
    rec = sharegpt(("system", "S"), ("human", "Q"), ("gpt", "A"))
    out = tokenize(tmp_path, [rec], SHAREGPT, chat_template="chatml")
    assert one(out) == expected([
        (chatml("system") + "S<|im_end|>\n" + chatml("user") + "Q<|im_end|>\n"
         + chatml("assistant"), False), ("A<|im_end|>", True), ("\n", False)])
    # Legacy keys and a custom role mapping give the same sample.
    legacy = {"type": "chat_template", "field_messages": "conversations",
              "message_field_role": "from", "message_field_content": "value",
              "roles": {"user": ["human"], "assistant": ["gpt"]}}
    assert one(tokenize(tmp_path, [rec], legacy, chat_template="chatml")) == one(out)


def test_roles_to_train_and_per_turn_flags(tmp_path):
    rec = {"messages": [{"role": "user", "content": "Q1"},
                        {"role": "assistant", "content": "A1", "training": False},
                        {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "A2"}]}
    entry = {"type": "chat_template", "roles_to_train": ["human", "assistant"]}
    out = tokenize(tmp_path, [rec], entry, chat_template="chatml")
    # human maps to user: user turns are targets; A1 is not (its flag), A2 is.
    assert one(out) == expected([
        (chatml("user"), False), ("Q1<|im_end|>", True),
        ("\n" + chatml("assistant") + "A1<|im_end|>\n" + chatml("user"), False),
        ("Q2<|im_end|>", True), ("\n" + chatml("assistant"), False), ("A2<|im_end|>", True),
        ("\n", False)])
    rec["messages"][1] = {"role": "assistant", "content": "A1", "train": True}
    rec["messages"][3] = {"role": "assistant", "content": "A2", "train": False}
    out = tokenize(tmp_path, [rec], {"type": "chat_template"}, chat_template="chatml")
    assert one(out) == expected([
        (chatml("user") + "Q1<|im_end|>\n" + chatml("assistant"), False),
        ("A1<|im_end|>", True),
        ("\n" + chatml("user") + "Q2<|im_end|>\n" + chatml("assistant") + "A2<|im_end|>\n",
         False)])


@pytest.mark.parametrize("mode", ["turn", "last", "all", "none"])
def test_train_on_eos(tmp_path, mode):
    rec = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}
    out = tokenize(tmp_path, [rec], {"type": "chat_template", "train_on_eos": mode},
                   chat_template="chatml")
    end = "<|im_end|>"
    user_end = mode == "all"
    a1_end = mode in ("turn", "all")
    a2_end = mode != "none"
    assert one(out) == expected([
        (chatml("user") + "Q1", False), (end, user_end), ("\n" + chatml("assistant"), False),
        ("A1", True), (end, a1_end), ("\n" + chatml("user") + "Q2", False), (end, user_end),
        ("\n" + chatml("assistant"), False), ("A2", True), (end, a2_end), ("\n", False)])


def test_named_templates_llama3_gemma3_phi3_qwen3(tmp_path):
    rec = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": " Q "},
                        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "R"},
                        {"role": "assistant", "content": "A2"}]}
    entry = {"type": "chat_template"}
    hdr = "<|start_header_id|>{}<|end_header_id|>\n\n".format
    assert one(tokenize(tmp_path, [rec], entry, chat_template="llama3")) == expected([
        (hdr("system") + "S<|eot_id|>" + hdr("user") + "Q<|eot_id|>" + hdr("assistant"), False),
        ("A1<|eot_id|>", True), (hdr("user") + "R<|eot_id|>" + hdr("assistant"), False),
        ("A2<|eot_id|>", True)])
    assert one(tokenize(tmp_path, [rec], entry, chat_template="gemma3")) == expected([
        ("<start_of_turn>user\nS\n\nQ<end_of_turn>\n<start_of_turn>model\n", False),
        ("A1<end_of_turn>", True),
        ("\n<start_of_turn>user\nR<end_of_turn>\n<start_of_turn>model\n", False),
        ("A2<end_of_turn>", True), ("\n", False)])
    assert one(tokenize(tmp_path, [rec], entry, chat_template="phi_3")) == expected([
        ("<|system|>\nS<|end|>\n<|user|>\n Q <|end|>\n<|assistant|>\n", False),
        ("A1<|end|>", True), ("\n<|user|>\nR<|end|>\n<|assistant|>\n", False),
        ("A2<|end|>", True), (EOS, False)])  # the byte tokenizer drops "\n" before eos
    # Qwen3 renders the final reply with an (empty) think block that a conversation cut
    # after A1 would put around A1 instead: located by offsets, the targets are still right.
    assert one(tokenize(tmp_path, [rec], entry, chat_template="qwen3")) == expected([
        (chatml("system") + "S<|im_end|>\n" + chatml("user") + " Q <|im_end|>\n"
         + chatml("assistant"), False), ("A1<|im_end|>", True),
        ("\n" + chatml("user") + "R<|im_end|>\n" + chatml("assistant")
         + "<think>\n\n</think>\n\n", False), ("A2<|im_end|>", True), ("\n", False)])


def test_jinja_template_from_file_and_tokenizer_default(tmp_path):
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}")
    rec = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    out = tokenize(tmp_path, [rec], {"type": "chat_template"}, chat_template="jinja",
                   chat_template_jinja=str(tmp_path / "t.jinja"))
    assert one(out) == expected([("[user]Q", False), (EOS, False), ("[assistant]", False),
                                 ("A", True), (EOS, True)])
    # The byte tokenizer's own template (tokenizer_default): `<|role|>\n`, replies end in eos.
    out = tokenize(tmp_path, [rec], {"type": "chat_template"})
    assert one(out) == expected([("<|user|>\nQ\n<|assistant|>\n", False), ("A", True),
                                 (EOS, True)])


def test_chat_malformed_records(tmp_path):
    entry = {"type": "chat_template"}
    ok = {"role": "user", "content": "Q"}
    out = tokenize(tmp_path, [
        {"messages": [{"role": "assistant", "content": "hello"}, ok]},
        {"messages": [ok, {"role": "assistant", "content": "  "}]},
        {"messages": [ok]},
    ], entry, chat_template="chatml")
    assert out["skip"] == ["starts with an assistant turn", "empty turn", "no target tokens"]
    bad = [({"messages": [ok, {"role": "robot", "content": "x"}]}, "'robot'"),
           ({"messages": [ok, {"role": "assistant"}]}, "`content`"),
           ({"messages": [ok, {"role": "assistant", "content": 5}]}, "string"),
           ({"messages": "hi"}, "list"), ({"messages": [ok, "x"]}, "mapping")]
    for record, words in bad:
        with pytest.raises(UserError) as err:
            tokenize(tmp_path, [{"messages": [ok, {"role": "assistant", "content": "A"}]},
                                record], entry, chat_template="chatml")
        assert "d.jsonl:2" in str(err.value) and words in str(err.value), str(err.value)
    with pytest.raises(UserError, match="no chat template|not a template longctx has"):
        tokenize(tmp_path, [{"messages": [ok]}], entry, chat_template="nope")


def test_offsets_with_a_fast_tokenizer():
    """A BPE tokenizer whose tokens span several characters: targets come from offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["<|im_start|>user\nhello there<|im_end|>\n"] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                  unk_token="<unk>")
    spec = formats.FormatSpec("chat_template", template=formats_chatml(),
                              end_markers=("<|im_end|>",))
    ids, labels, _ = formats.chat({"messages": [{"role": "user", "content": "hello"},
                                                {"role": "assistant", "content": "there hello"}]},
                                  spec, tok, "here")
    assert ids == tok(tok.apply_chat_template(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there hello"}],
        chat_template=formats_chatml(), tokenize=False), add_special_tokens=False)["input_ids"]
    targets = [t for t, lab in zip(ids, labels, strict=True) if lab != IGN]
    assert tok.decode(targets) == "there hello<|im_end|>"
    assert len(targets) < len("there hello") + 1  # tokens of several characters
    assert labels[-1] == IGN  # the newline after the end marker


def formats_chatml() -> str:
    from longctx_cli.data.chat_templates import CHATML

    return CHATML


# ---- input_output -----------------------------------------------------------------------


def test_input_output_segments(tmp_path):
    rec = {"segments": [{"label": False, "text": "Q: 2+2?\n"}, {"label": True, "text": "A: 4"},
                        {"label": False, "text": "\n--\n"}, {"label": True, "text": "end"}]}
    entry = {"type": "input_output"}
    assert one(tokenize(tmp_path, [rec], entry)) == expected([
        ("Q: 2+2?\n", False), ("A: 4", True), ("\n--\n", False), ("end", True)])
    ids, labels = one(tokenize(tmp_path, [rec], entry, train_on_inputs=True))
    assert labels == ids
    with pytest.raises(UserError) as err:
        tokenize(tmp_path, [rec, {"segments": [{"label": "yes", "text": "x"}]}], entry)
    assert "d.jsonl:2" in str(err.value) and "boolean" in str(err.value)


# ---- through prepare: files in the shapes users have, and the report --------------------


def test_prepare_report_counts_skips_targets_and_shows_a_sample(tmp_path):
    lines = [sharegpt(("human", f"Q{i}"), ("gpt", f"A{i}")) for i in range(3)]
    lines.append(sharegpt(("gpt", "hi"), ("human", "Q")))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    p = prepare(cfg(tmp_path, SHAREGPT, chat_template="chatml"), progress=False)
    (stats,) = p.report.datasets
    assert (stats.records, stats.skipped) == (4, 1)
    assert stats.skip_reasons == {"starts with an assistant turn": 1}
    assert stats.target_tokens == 3 * len(enc("A0<|im_end|>"))
    text = str(p.report)
    assert "Sample of" in text and "⟦A0<|im_end|>⟧" in text
    assert "\n<|im_start|>user\nQ0<|im_end|>\n<|im_start|>assistant\n⟦A0" in text
    assert "target" in text and "1 (starts" in text


def test_data_files_csv_shards_and_text_column(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.csv").write_text("body,other\nfirst row,x\nsecond row,y\n")
    (folder / "b.csv").write_text("body,other\nthird row,z\n")
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 64,
        "datasets": [{"path": str(folder), "data_files": ["a.csv", "b.csv"],
                      "type": "completion", "field": "body"},
                     {"path": str(folder), "data_files": "a.csv", "type": "pretrain",
                      "text_column": "body", "shards": 2, "shards_idx": 1}]})
    p = prepare(config, progress=False)
    docs = sorted(TOK.decode(r["input_ids"][s:e]) for r in p.train
                  for s, e in _doc_bounds(r["position_ids"]))
    first, second = p.report.datasets
    assert first.records == 3 and second.records == 1
    assert [d for d in docs if "row" in d and d.count("</s>") == 1] == sorted(docs)
    assert sum(d in ("first row</s>", "second row</s>") for d in docs) == 3  # 2 + the shard


def _doc_bounds(pos: list[int]) -> list[tuple[int, int]]:
    starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
    return list(zip(starts, starts[1:], strict=False))


def test_ds_type_reads_a_file_without_a_known_suffix(tmp_path):
    f = tmp_path / "export.data"
    f.write_text(json.dumps({"text": "hello"}) + "\n")
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(f), "ds_type": "json"}]})
    p = prepare(config, progress=False)
    assert TOK.decode(p.train[0]["input_ids"]) == "hello</s>"


def test_path_json_with_data_files_reads_local_files(tmp_path, monkeypatch):
    """Hugging Face's (and Axolotl's) `path: json` + `data_files:` form: `json` names the
    packaged loader, not a hub repository; the files are relative to the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "packaged form"}) + "\n")
    (tmp_path / "more.data").write_text(json.dumps({"text": "any suffix"}) + "\n")
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": "json", "data_files": ["train.jsonl", "more.data"],
                      "type": "completion"}]})
    p = prepare(config, progress=False)
    docs = sorted(TOK.decode(r["input_ids"][s:e]) for r in p.train
                  for s, e in _doc_bounds(r["position_ids"]))
    assert docs == ["any suffix</s>", "packaged form</s>"]
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": "csv", "data_files": "missing.csv", "type": "completion"}]})
    with pytest.raises(UserError, match="'missing.csv' does not exist"):
        prepare(config, progress=False)

"""`tokenizer_use_mistral_common: true`: the tokenizer is mistral-common's (through
transformers' MistralCommonBackend), and a chat's ids and targets are mistral-common's own.

The tokenizer files are the ones the mistral-common package ships in its data/ folder: its
Tekken v3 file as it is, and the same vocabulary declared v7 (the system-prompt tokens of
Magistral and Devstral). The reference is mistral-common itself: `encode_chat_completion` of
the same conversation for the ids, and its encoding of each assistant message alone for the
targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

mistral_common = pytest.importorskip("mistral_common")

from mistral_common.protocol.instruct.messages import (  # noqa: E402
    AssistantMessage,
    SystemMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.validator import ValidationMode  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

from longctx_cli.config.load import config_from_dict  # noqa: E402
from longctx_cli.data import formats  # noqa: E402
from longctx_cli.data.prepare import format_spec, prepare  # noqa: E402
from longctx_cli.data.tokenizer import load_tokenizer  # noqa: E402
from longctx_cli.errors import UserError  # noqa: E402

IGN = -100
TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."}]


def _folder(tmp_path: Path, version: str) -> Path:
    """A tokenizer folder holding the shipped Tekken file, declared `version`."""
    data = json.loads(TEKKEN.read_text())
    data["config"]["version"] = version
    data.pop("image", None)  # a text tokenizer
    folder = tmp_path / f"tekken_{version}"
    folder.mkdir()
    (folder / "tekken.json").write_text(json.dumps(data))
    return folder


def _config(tmp_path: Path, folder: Path, entry: dict | None = None, **top):
    return config_from_dict({
        "model_config": {"model_type": "mistral"}, "tokenizer": str(folder),
        "tokenizer_use_mistral_common": True,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "chat_template",
                      **(entry or {})}], **top})


def _tokenize(config, tok, records: list[dict]) -> dict[str, list]:
    spec = format_spec(config.data.datasets[0], config, tok)
    batch = {k: [r.get(k) for r in records] for k in {k for r in records for k in r}}
    return formats.tokenize_batch(batch, list(range(len(records))), spec=spec, tok=tok,
                                  where=lambda i: f"d.jsonl:{i + 1}")


def _reference(folder: Path, chat: list[dict]) -> tuple[list[int], list[int]]:
    """mistral-common's ids of the chat, and labels marking each assistant message's own
    tokens (its content and eos, as mistral-common encodes that message alone)."""
    mt = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.finetuning)
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in chat]
    ids = mt.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
    labels, at = [IGN] * len(ids), 0
    last_user = max(n for n, m in enumerate(chat) if m["role"] == "user")
    for n, message in enumerate(messages):
        if chat[n]["role"] != "assistant":
            continue
        own = mt.instruct_tokenizer.encode_assistant_message(
            message, is_before_last_user_message=n < last_user)
        at = next(i for i in range(at, len(ids)) if ids[i:i + len(own)] == own)
        labels[at:at + len(own)] = own
        at += len(own)
    return ids, labels


@pytest.mark.parametrize("version", ["v3", "v7"])
def test_chat_ids_and_assistant_targets_are_mistral_commons_own(tmp_path, version):
    folder = _folder(tmp_path, version)
    config = _config(tmp_path, folder)
    tok = load_tokenizer(config)
    assert type(tok).__name__ == "MistralCommonBackend" and tok.pad_token_id is not None
    out = _tokenize(config, tok, [{"messages": CHAT}])
    assert out["skip"] == [""]
    ids, labels = _reference(folder, CHAT)
    assert out["input_ids"][0] == ids and out["labels"][0] == labels
    targets = [t for t in labels if t != IGN]
    assert tok.decode(targets) == "Paris.</s>Rome, since 1871.</s>"
    assert targets.count(tok.eos_token_id) == 2 and ids[0] == tok.bos_token_id


def test_train_on_eos_and_roles_to_train(tmp_path):
    folder = _folder(tmp_path, "v7")
    ids, full = _reference(folder, CHAT)
    eos = ids.count(2) and 2
    for mode, eos_targets in (("none", 0), ("last", 1), ("turn", 2)):
        config = _config(tmp_path, folder, {"train_on_eos": mode})
        tok = load_tokenizer(config)
        labels = _tokenize(config, tok, [{"messages": CHAT}])["labels"][0]
        assert labels.count(eos) == eos_targets
        assert [t for t in labels if t not in (IGN, eos)] == [t for t in full
                                                               if t not in (IGN, eos)]
    # Training the user turns too (v7 keeps the system prompt apart): their content only.
    config = _config(tmp_path, folder, {"roles_to_train": ["user", "assistant"]})
    tok = load_tokenizer(config)
    labels = _tokenize(config, tok, [{"messages": CHAT}])["labels"][0]
    assert tok.decode([t for t in labels if t != IGN], skip_special_tokens=True) == (
        "What is the capital of France?Paris.And of Italy?Rome, since 1871.")


def test_a_turn_merged_with_the_system_prompt_is_refused_not_guessed(tmp_path):
    # Tekken v3 writes the system prompt into the last user turn: its content cannot be told
    # apart token by token when they merge, and training it is refused with the way out.
    folder = _folder(tmp_path, "v3")
    config = _config(tmp_path, folder, {"roles_to_train": ["user", "assistant"]})
    tok = load_tokenizer(config)
    chat = [{**CHAT[0], "content": "Be brief"}, CHAT[1], CHAT[2],
            {"role": "user", "content": "\n\nAnd of Italy?"}, CHAT[4]]
    with pytest.raises(UserError, match="cannot locate turn 3 in mistral-common"):
        _tokenize(config, tok, [{"messages": chat}])


def test_prepare_end_to_end_and_the_cache_tells_the_tokenizers_apart(tmp_path):
    from longctx_cli.data.cache import inputs_parts

    folder = _folder(tmp_path, "v7")
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(tmp_path, folder, sequence_len=256)
    (stats,) = prepare(config, progress=False).report.datasets
    assert (stats.records, stats.skipped) == (2, 0)
    assert stats.target_tokens == sum(
        sum(t != IGN for t in _reference(folder, r["messages"])[1]) for r in rows)
    # The same files read by transformers' own tokenizer would be another cache entry.
    plain = config.model_copy(update={"tokenizer_use_mistral_common": False})
    assert inputs_parts(config)["tokenizer_source"] != inputs_parts(plain)["tokenizer_source"]


def test_completion_text_is_mistral_commons_plain_tokens(tmp_path):
    folder = _folder(tmp_path, "v7")
    config = _config(tmp_path, folder, {"type": "completion"})
    tok = load_tokenizer(config)
    out = _tokenize(config, tok, [{"text": "Hello world, this is text."}])
    mt = MistralTokenizer.from_file(str(folder / "tekken.json"))
    plain = mt.instruct_tokenizer.tokenizer.encode("Hello world, this is text.", bos=True,
                                                    eos=True)
    assert out["input_ids"][0] == plain == out["labels"][0]


@pytest.mark.parametrize("extra, named", [
    ({"tokenizer": "byte"}, "`tokenizer: byte`"),
    ({"special_tokens": {"pad_token": "<pad>"}}, "`special_tokens`"),
    ({"chat_template": "chatml"}, "`chat_template: chatml`"),
    ({"datasets": [{"path": "x.jsonl", "type": "alpaca"}]}, "dataset `type: alpaca`"),
    ({"rl": "dpo", "datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]},
     "`rl: dpo`"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template",
                    "field_thinking": "reasoning"}]}, "`field_thinking`"),
])
def test_what_it_cannot_go_with_is_refused_by_name(extra, named):
    raw = {"model_config": {"model_type": "mistral"}, "tokenizer": "/x",
           "tokenizer_use_mistral_common": True,
           "datasets": [{"path": "x.jsonl", "type": "chat_template"}], **extra}
    with pytest.raises(UserError) as err:
        config_from_dict(raw)
    assert "tokenizer_use_mistral_common: true` with " + named in err.value.message
    assert "drop one of them" in err.value.message


def test_a_folder_without_a_mistral_common_file_is_a_user_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="could not load the mistral-common tokenizer"):
        load_tokenizer(_config(tmp_path, tmp_path / "empty"))


def test_without_the_package_the_error_names_the_install(tmp_path, monkeypatch):
    # An environment without mistral-common, as transformers' own check reports it there.
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_mistral_common_available", lambda: False)
    with pytest.raises(UserError) as err:
        load_tokenizer(_config(tmp_path, _folder(tmp_path, "v3")))
    assert err.value.where == "tokenizer_use_mistral_common"
    assert "pip install 'longctx[mistral]'" in str(err.value)


def test_validate_reads_the_records_with_the_mistral_common_tokenizer(tmp_path):
    # `longctx validate` tokenizes the first records as preprocess does, with the same ids.
    from longctx_cli.data.check import check_data

    folder = _folder(tmp_path, "v7")
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    (line,) = check_data(_config(tmp_path, folder))
    assert line.endswith(f"1 records read, {len(_reference(folder, CHAT)[0])} tokens"), line

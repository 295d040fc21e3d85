"""`longctx validate` reads the data (issue 71): the first records of every dataset file,
through preprocess's own parsers and with its messages, writing nothing. Each mistake a user
makes in a dataset is one paragraph and exit 2 through the real CLI; the report says how many
records were read; the fix validates when taken."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from longctx_cli.cli import app
from longctx_cli.data.check import TEXT_RECORDS
from tests.vlm_fixtures import write_tiny_qwen_vl_processor

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner(env={"COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
TEXT = {"model_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 384},
        "tokenizer": "byte", "sequence_len": 512, "fidelity_probe": False}


def validate(tmp_path: Path, data: dict, *args: str) -> tuple[int, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**data, "output_dir": str(tmp_path / "out")}))
    result = runner.invoke(app, ["validate", str(path), *args])
    return result.exit_code, " ".join(result.output.split())


def jsonl(path: Path, *records: object) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def entry(path: str, **keys: object) -> dict:
    return {**TEXT, "datasets": [{"path": path, **keys}]}


def one_error(code: int, out: str) -> str:
    assert code == 2, out
    assert out.count("error: ") == 1 and "Traceback" not in out, out  # one paragraph
    assert "fidelity probe:" not in out.split("error: ")[1], out  # it stopped there
    return out.split("error: ")[1]


def test_records_are_read_and_counted_and_nothing_is_written(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", *({"text": f"document {i}"} for i in range(TEXT_RECORDS + 5)))
    before = sorted(tmp_path.rglob("*"))
    code, out = validate(tmp_path, entry(f, type="completion"))
    assert code == 0, out
    assert (f"data: datasets[0] {f}: {TEXT_RECORDS} records read (the first {TEXT_RECORDS} of "
            "more),") in out
    assert set(tmp_path.rglob("*")) == {*before, tmp_path / "config.yaml"}  # no cache
    small = jsonl(tmp_path / "s.jsonl", {"text": "a"}, {"text": "b"})
    code, out = validate(tmp_path, entry(small, type="completion"))
    assert code == 0 and f"data: datasets[0] {small}: 2 records read, " in out, out


def test_a_truncated_json_line_names_its_line(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", {"text": "ok"}, '{"text": "cut sh')
    out = one_error(*validate(tmp_path, entry(f, type="completion")))
    assert f"{f}:2: invalid JSON" in out and "one complete JSON object" in out


def test_records_without_the_configured_field(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", {"body": "a"}, {"body": "b"})
    out = one_error(*validate(tmp_path, entry(f, type="completion", field="text")))
    assert f"{f}: has no field 'text' (fields: body)" in out and "set `field:`" in out
    assert validate(tmp_path, entry(f, type="completion", field="body"))[0] == 0


def test_a_record_missing_the_field_others_have_is_counted_as_preprocess_does(
        tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", {"text": "a"}, {"title": "b"})
    code, out = validate(tmp_path, entry(f, type="completion"))
    assert code == 0 and "2 records read" in out and "1 give no sample (1 empty text)" in out


def test_the_wrong_type_for_the_records(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", {"text": "a"})
    out = one_error(*validate(tmp_path, entry(f, type="alpaca")))
    assert "has no field 'instruction'" in out and "`alpaca` dataset needs the columns" in out
    assert validate(tmp_path, entry(f, type="completion"))[0] == 0


def test_chat_records_without_targets(tmp_path: Path) -> None:
    user_only = {"messages": [{"role": "user", "content": "hello"}]}
    f = jsonl(tmp_path / "d.jsonl", user_only, user_only)
    out = one_error(*validate(tmp_path, entry(f, type="chat_template"),
                              "--chat-template", "chatml"))
    assert "none of the 2 records read gives a sample to train on (2 no target tokens)" in out
    reply = {"messages": [*user_only["messages"], {"role": "assistant", "content": "hi"}]}
    jsonl(tmp_path / "d.jsonl", user_only, reply)
    code, out = validate(tmp_path, entry(f, type="chat_template"), "--chat-template", "chatml")
    assert code == 0 and "1 give no sample (1 no target tokens)" in out, out


def test_a_sample_longer_than_sequence_len(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "d.jsonl", {"text": "x" * 600}, {"text": "short"})
    strict = {**entry(f, type="completion"), "excess_length_strategy": "error"}
    out = one_error(*validate(tmp_path, strict))
    assert f"{f}:1: a sample is 601 tokens long, more than sequence_len (512); 1 of the 2 " \
        "records read are" in out
    code, out = validate(tmp_path, entry(f, type="completion"))  # the default drops it
    assert code == 0 and "1 give no sample (1 longer than sequence_len, dropped" in out, out
    assert validate(tmp_path, {**strict, "excess_length_strategy": "truncate"})[0] == 0


# ---- images --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The bundled tiny VLM example, its processor written to a temporary folder."""
    folder = write_tiny_qwen_vl_processor(tmp_path_factory.mktemp("proc"))
    data = yaml.safe_load((ROOT / "examples" / "tiny_vlm.yaml").read_text())
    return {**data, "processor_path": str(folder), "tokenizer": str(folder),
            "fidelity_probe": False}


def image_chat(path: str) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "path": path},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A square."}]}


def write_png(path: Path, side: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(path)


def test_an_image_that_does_not_exist_or_does_not_decode(tmp_path: Path, vlm: dict) -> None:
    f = jsonl(tmp_path / "d.jsonl", image_chat("missing.png"))
    out = one_error(*validate(tmp_path, {**vlm, "datasets": [{"path": f,
                                                               "type": "chat_template"}]}))
    assert f"{f}:1" in out and "missing.png" in out, out
    (tmp_path / "notes.png").write_text("not an image")
    jsonl(tmp_path / "d.jsonl", image_chat("notes.png"))
    out = one_error(*validate(tmp_path, {**vlm, "datasets": [{"path": f,
                                                               "type": "chat_template"}]}))
    assert f"{f}:1" in out and "notes.png" in out, out
    write_png(tmp_path / "square.png", 56)
    jsonl(tmp_path / "d.jsonl", image_chat("square.png"))
    code, out = validate(tmp_path, {**vlm, "datasets": [{"path": f, "type": "chat_template"}]})
    assert code == 0 and "1 records read" in out and "1 images decoded" in out, out


def test_image_tokens_past_sequence_len(tmp_path: Path, vlm: dict) -> None:
    write_png(tmp_path / "big.png", 448)
    f = jsonl(tmp_path / "d.jsonl", image_chat("big.png"))
    data = {**vlm, "sequence_len": 32, "excess_length_strategy": "error",
            "datasets": [{"path": f, "type": "chat_template"}]}
    out = one_error(*validate(tmp_path, data))
    assert f"{f}:1" in out and "image/video tokens" in out and "sequence_len 32" in out, out
    code, out = validate(tmp_path, {**data, "sequence_len": 64})
    assert code == 0, out

"""The built-in byte tokenizer and `load_tokenizer`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longctx_cli.config.load import config_from_dict
from longctx_cli.data.formats import render_chat
from longctx_cli.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from longctx_cli.errors import UserError


def _config(**kw):
    return config_from_dict({"model_config": {"model_type": "llama"}, **kw})


def test_byte_tokenizer_ids_and_specials():
    tok = load_tokenizer(_config(tokenizer="byte"))
    assert len(tok) == 384
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok("Ab")["input_ids"] == [ord("A") + 3, ord("b") + 3, 1]
    assert tok.decode(tok("héllo")["input_ids"], skip_special_tokens=True) == "héllo"


def test_byte_tokenizer_round_trips_in_a_fresh_process(tmp_path):
    tok = load_tokenizer(_config(tokenizer="byte"))
    tok.save_pretrained(tmp_path / "tok")
    code = (
        "import sys, json\n"
        "from transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "msgs = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]\n"
        "print(json.dumps([t('pass key 12345')['input_ids'], t.pad_token_id, len(t),\n"
        "                  t.apply_chat_template(msgs, tokenize=False)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tok")],
                         capture_output=True, text=True, check=True, timeout=120)
    import json

    ids, pad, size, chat = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == tok("pass key 12345")["input_ids"]
    assert (pad, size) == (0, 384)
    assert chat == "<|user|>\nhi\n<|assistant|>\nyo</s>"
    # Loaded back from the saved folder, it is the same tokenizer to the fingerprint.
    reloaded = load_tokenizer(_config(tokenizer=str(tmp_path / "tok")))
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tok)


def test_byte_chat_template_marks_only_assistant_replies():
    tok = load_tokenizer(_config(tokenizer="byte"))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
    ids, labels = render_chat(tok, msgs, "here")
    assert ids == tok(tok.apply_chat_template(msgs, tokenize=False),
                      add_special_tokens=False)["input_ids"]
    targets = [i for i, lab in zip(ids, labels, strict=True) if lab != -100]
    assert tok.decode(targets) == "A1</s>A2</s>"


def test_missing_tokenizer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="could not load the tokenizer"):
        load_tokenizer(_config(tokenizer=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="tokenizer: byte"):
        load_tokenizer(_config())


def test_generate_says_why_its_continuation_is_empty():
    from longctx_cli.eval.generate import empty_continuation_note

    tok = load_tokenizer(_config(tokenizer="byte"))
    first_eos = empty_continuation_note([tok.eos_token_id], tok)
    assert "first token was its end-of-sequence token" in first_eos
    assert f"id {tok.eos_token_id}" in first_eos
    blank = empty_continuation_note([tok.pad_token_id] * 9, tok)
    assert "9 new token(s) (0, 0, 0, 0, 0, 0, 0, 0, ...)" in blank
    assert "end-of-sequence" not in blank

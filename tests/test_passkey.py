"""The passkey generator: exact length, key where it says, determinism, labels."""

from __future__ import annotations

import random

import pytest

from longctx_cli.constants import IGNORE_INDEX as IGNORE
from longctx_cli.data.passkey import (
    INTRO,
    QUESTION,
    generate_passkey_samples,
    make_passkey_sample,
    passkey_grid,
    training_labels,
)
from longctx_cli.data.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("context_len", [300, 1000])
def test_key_is_where_it_says(tok, depth, context_len):
    s = make_passkey_sample(tok, context_len, depth, 5, random.Random(3))
    assert len(s) == len(s.input_ids) == context_len
    assert len(s.key) == 5 and s.key.isdigit()
    start, end = s.key_span
    assert tok.decode(s.prompt_ids[start:end]) == s.key
    needle = tok.decode(s.prompt_ids[s.needle_pos:end])
    assert needle == f" The pass key is [{s.key}"
    close = tok("]", add_special_tokens=False)["input_ids"]
    assert s.answer_ids == s.prompt_ids[start:end] + close + [tok.eos_token_id]
    assert tok.decode(s.prompt_ids).endswith(QUESTION)
    # The needle sits within one filler sentence (about 90 bytes) of the requested depth.
    intro = len(tok(INTRO, add_special_tokens=False)["input_ids"])
    needle_len = len(f" The pass key is [{s.key}]. Remember it. [{s.key}] is the pass key.")
    filler_len = context_len - len(s.answer_ids) - len(QUESTION) - needle_len - intro
    assert abs((s.needle_pos - intro) - depth * filler_len) <= 92


def test_key_opener_occurs_only_in_the_needle_and_at_the_question_end(tok):
    # What makes retrieval a single unambiguous copy: the prompt's last token marks the key.
    s = make_passkey_sample(tok, 600, 0.5, 5, random.Random(1))
    opener = s.prompt_ids[-1]
    where = [i for i, t in enumerate(s.prompt_ids) if t == opener]
    start, end = s.key_span
    assert where[0] == start - 1 and where[-1] == len(s.prompt_ids) - 1
    assert len(where) == 3  # the key's two mentions in the needle, and the question


def test_same_seed_same_samples_other_seed_other_keys(tok):
    a = generate_passkey_samples(tok, 12, [256, 400], None, 6, seed=7)
    b = generate_passkey_samples(tok, 12, [256, 400], None, 6, seed=7)
    c = generate_passkey_samples(tok, 12, [256, 400], None, 6, seed=8)
    assert a == b
    assert [s.key for s in a] != [s.key for s in c]
    assert [len(s) for s in a] == [256, 400] * 6


def test_grid_cycles_over_every_cell():
    grid = passkey_grid(7, [10, 20], [0.0, 1.0])
    assert grid == [(10, 0.0), (20, 0.0), (10, 1.0), (20, 1.0), (10, 0.0), (20, 0.0), (10, 1.0)]


def test_training_labels_mask_only_the_unpredictable_first_mention(tok):
    s = make_passkey_sample(tok, 400, 0.5, 5, random.Random(0))
    labels = training_labels(s)
    start, end = s.key_span
    assert labels[start:end] == [IGNORE] * (end - start)
    assert labels[:start] == s.input_ids[:start]
    assert labels[end:] == s.input_ids[end:]
    assert labels[-len(s.answer_ids):] == s.answer_ids  # the answer is always a target


def test_too_short_context_is_rejected(tok):
    with pytest.raises(ValueError, match="too short"):
        make_passkey_sample(tok, 50, 0.5, 5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        make_passkey_sample(tok, 500, 1.5, 5, random.Random(0))

"""Per-type tokenization: raw records -> samples with `input_ids`, `labels`, `position_ids`.

A *sample* is one document (or, for `pretrain`, one piece of the concatenated stream that
may hold several document fragments). Labels are aligned with `input_ids` (Hugging Face
convention; the trainer shifts) and are -100 where no loss is wanted. The -100 on the first
token of every document is applied later, when rows are built (`pack.py`), in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100
CHAT_ROLES = ("system", "user", "assistant", "tool")
Where = Callable[[int], str]
# Characters per token, generously: byte tokenizers give 1, BPE about 4 on prose, more on
# long runs of whitespace. A record with more characters than this per token of
# sequence_len cannot fit; it is cut to that size *before* tokenizing, so one 30 MB line
# costs a bounded slice of tokenizer time and memory instead of minutes and gigabytes.
MAX_CHARS_PER_TOKEN = 32


def max_record_chars(sequence_len: int) -> int:
    """Characters of one record that are tokenized at most (see MAX_CHARS_PER_TOKEN)."""
    return sequence_len * MAX_CHARS_PER_TOKEN


def _check_cut(ids: list[int], chars: int, max_chars: int, where: str) -> None:
    """A record cut to `max_chars` must still be over sequence_len tokens, so that
    `excess_length_strategy` treats it as too long; if not, its text is pathological."""
    if len(ids) <= max_chars // MAX_CHARS_PER_TOKEN:
        raise UserError(
            f"a record of {chars:,} characters averages more than {MAX_CHARS_PER_TOKEN} "
            "characters per token, so its length cannot be judged without tokenizing all of "
            "it; records this long are cut before tokenizing.",
            where=where,
            fix="split or shorten that record (or remove it); raising `sequence_len` raises "
            "the cut too.",
        )


def encode_document(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of one document with the tokenizer's specials, always ending in eos.

    eos at the end teaches the model where a document stops; tokenizers that add it
    themselves (the byte one) do not get a second one.
    """
    ids = list(tok(text)["input_ids"])
    eos = tok.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def _text(record_value: Any, field: str, where: str) -> str:
    if record_value is None:
        return ""
    if not isinstance(record_value, str):
        raise UserError(
            f"field `{field}` must be a string, found {type(record_value).__name__}.",
            where=where,
            fix="store the text as a string, or point `field` at the column that holds it.",
        )
    return record_value


def completion_batch(
    batch: dict[str, list], indices: list[int], *, tok: PreTrainedTokenizerBase, field: str,
    where: Where, max_chars: int | None = None,
) -> dict[str, list]:
    """`completion`: the whole text is a target. Empty texts give empty samples (skipped).

    Texts over `max_chars` are cut before tokenizing (the sample is still too long, and
    `excess_length_strategy` drops, truncates or reports it as usual).
    """
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for value, i in zip(batch[field], indices, strict=True):
        text = _text(value, field, where(i))
        cut = max_chars is not None and len(text) > max_chars
        ids = encode_document(tok, text[:max_chars] if cut else text) if text.strip() else []
        if cut:
            _check_cut(ids, len(text), max_chars, where(i))
        _append(out, ids, list(ids))
    return out


def pretrain_batch(
    batch: dict[str, list], indices: list[int], *, tok: PreTrainedTokenizerBase, field: str,
    where: Where, max_chars: int | None = None,
) -> dict[str, list]:
    """`pretrain`, step 1: each document's ids; `pretrain_pieces` then cuts the stream.

    `max_chars` is unused: a long document is never too long here, it spans several pieces.
    """
    out: dict[str, list] = {"input_ids": []}
    for value, i in zip(batch[field], indices, strict=True):
        text = _text(value, field, where(i))
        out["input_ids"].append(encode_document(tok, text) if text.strip() else [])
    return out


def pretrain_pieces(
    docs: Iterator[list[int]], sequence_len: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Concatenate documents and cut the stream into pieces of exactly `sequence_len`.

    Yields (input_ids, position_ids); position_ids restart at 0 at every document start and
    at every piece start (a fragment continued from the previous piece is a new document to
    the trainer). Only the last piece may be shorter; no token is lost.
    """
    ids: list[int] = []
    pos: list[int] = []
    for doc in docs:
        start = 0
        while start < len(doc):
            take = min(sequence_len - len(ids), len(doc) - start)
            ids.extend(doc[start : start + take])
            pos.extend(range(take))
            start += take
            if len(ids) == sequence_len:
                yield ids, pos
                ids, pos = [], []
    if ids:
        yield ids, pos


def chat_batch(
    batch: dict[str, list], indices: list[int], *, tok: PreTrainedTokenizerBase, field: str,
    where: Where, max_chars: int | None = None,
) -> dict[str, list]:
    """`chat_template`: render with the tokenizer's template; only assistant turns are targets.

    A conversation whose turns hold more than `max_chars` characters is cut there (later
    turns dropped) before rendering; the sample is still too long, see `completion_batch`.
    """
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for value, i in zip(batch[field], indices, strict=True):
        messages = _check_messages(value, field, where(i))
        chars = sum(len(m["content"]) for m in messages)
        cut = max_chars is not None and chars > max_chars
        if cut:
            messages = _cut_turns(messages, max_chars)
        ids, labels = render_chat(tok, messages, where(i))
        if cut:
            _check_cut(ids, chars, max_chars, where(i))
        if all(label == IGNORE for label in labels):
            ids, labels = [], []  # nothing to learn from: skipped like an empty text
        _append(out, ids, labels)
    return out


def _cut_turns(messages: list[dict[str, str]], max_chars: int) -> list[dict[str, str]]:
    """The turns up to `max_chars` characters of content, the last one cut."""
    kept, left = [], max_chars
    for turn in messages:
        if left <= 0:
            break
        kept.append({"role": turn["role"], "content": turn["content"][:left]})
        left -= len(turn["content"])
    return kept


def _check_messages(value: Any, field: str, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise UserError(
            f"field `{field}` must be a non-empty list of turns, found "
            f"{type(value).__name__ if value is not None else 'null'}.",
            where=where,
            fix='write it as [{"role": "user", "content": "..."}, '
            '{"role": "assistant", "content": "..."}].',
        )
    for n, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise UserError(
                f"turn {n} of `{field}` must have `role` and `content`, found {turn!r:.80}.",
                where=where,
                fix='write each turn as {"role": "user", "content": "..."}.',
            )
        if turn["role"] not in CHAT_ROLES:
            raise UserError(
                f"turn {n} of `{field}` has unknown role {turn['role']!r}.",
                where=where,
                fix=f"use one of {', '.join(CHAT_ROLES)}.",
            )
        if not isinstance(turn["content"], str):
            raise UserError(
                f"turn {n} of `{field}` has non-string content ({type(turn['content']).__name__}).",
                where=where,
                fix="give every turn's `content` as a string.",
            )
    return [{"role": t["role"], "content": t["content"]} for t in value]


def render_chat(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], where: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation; assistant replies (and their end marker) are targets.

    The conversation is rendered as text once per assistant turn: the text up to the reply
    (with the generation prompt) and the text including it. Their difference is the reply.
    The text is cut at those offsets and each piece tokenized on its own, so labels line up
    with tokens exactly for any template that renders a conversation's prefix as a prefix.
    """
    full = _render(tok, messages, where, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for n, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render(tok, messages[:n], where, add_generation_prompt=True) if n else None
        if before is None:
            before = _render(tok, [], where, add_generation_prompt=True)
        upto = _render(tok, messages[: n + 1], where, add_generation_prompt=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise UserError(
                "the tokenizer's chat template does not render a conversation's start as the "
                "start of the whole conversation, so assistant turns cannot be located.",
                where=where,
                fix="use a tokenizer whose chat template is prefix-stable, or the `completion` "
                "type on pre-rendered text.",
            )
        spans.append((len(before), len(upto)))
    ids: list[int] = []
    labels: list[int] = []
    cursor = 0
    for start, end in spans:
        piece = _encode_piece(tok, full[cursor:start])
        ids += piece
        labels += [IGNORE] * len(piece)
        reply = _encode_piece(tok, full[start:end])
        ids += reply
        labels += reply
        cursor = end
    rest = _encode_piece(tok, full[cursor:])
    return ids + rest, labels + [IGNORE] * len(rest)


def _render(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], where: str,
    *, add_generation_prompt: bool,
) -> str:
    if not tok.chat_template:
        raise UserError(
            "the tokenizer has no chat template, so `type: chat_template` cannot render turns.",
            where=where,
            fix="use a tokenizer with a chat template (or `tokenizer: byte`), "
            "or `type: completion`.",
        )
    try:
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - jinja templates raise anything; it is the data's fault
        raise UserError(
            f"the chat template rejected this conversation: {exc}",
            where=where,
            fix="check the roles and turn order the model's template expects.",
        ) from None


def _encode_piece(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def _append(out: dict[str, list], ids: list[int], labels: list[int]) -> None:
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out["position_ids"].append(list(range(len(ids))))

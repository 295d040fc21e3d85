"""Preference pairs: one record -> one sample holding its chosen and its rejected sequence.

A pair sample is two documents back to back, `[prompt + chosen]` then `[prompt + rejected]`,
positions from 0 in each, targets only on the answer tokens. Packing moves a pair as one
unit, so in every row (and every micro-batch, rows being whole) document `2k` is the chosen
and `2k + 1` the rejected sequence of the same pair; the trainer reads the pairing from
that order alone (`train/preference.py`).

Tokenization is TRL's (`DPOTrainer`) for text prompts: an eos is appended to each answer
that does not end with one, `prompt` and `prompt + answer` are tokenized whole, and the
answer starts where the two token lists first differ (a merge across the boundary moves it
back, as it does in TRL). `rl: orpo` tokenizes as TRL's `ORPOTrainer` does instead
(`orpo_pair_sample`): without the tokenizer's special tokens, the bos id put before each
sequence that does not start with it, the eos id after each answer. The prompt strings of
the `chatml.*` and `llama3.*` types are Axolotl's; `bradley_terry.chat_template` (Axolotl's
reward-model type) renders `system` (if any) and `input` as the prompt turns and `chosen`,
`rejected` as the assistant's answers with the chat template; `chat_template.default` renders
`field_messages` with the model's own template.
"""

from __future__ import annotations

from os.path import commonprefix  # any two sequences, token lists included
from typing import TYPE_CHECKING, Any

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The prompt templates of Axolotl's preference types: (system block, user block + opening of
# the assistant turn, end of an answer).
TEMPLATES = {
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
               "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
               "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}
# type suffix -> (prompt keys tried in order, chosen keys, rejected keys)
_FIELDS = {
    "intel": (("question",), ("chosen",), ("rejected",)),
    "icr": (("input",), ("chosen",), ("rejected",)),
    "prompt_pairs": (("prompt",), ("chosen",), ("rejected",)),
    "argilla": (("prompt", "input", "question", "instruction"), ("chosen", "chosen_response"),
                ("rejected", "rejected_response")),
}
# Types whose answers are conversations `[{user turn}, {assistant turn}]`: the answer is the
# assistant turn's content; `ultra` reads the prompt from `prompt`, `argilla_chat` from the
# chosen conversation's user turn.
_CONVERSATION_KINDS = ("ultra", "argilla_chat")
# The types this module renders; config.schema declares them (PREFERENCE_TYPES).
RENDERED_TYPES = (
    "preference", "chat_template.default", "chat_template.argilla",
    "bradley_terry.chat_template",
    *(f"{style}.{kind}" for style in TEMPLATES for kind in (*_FIELDS, *_CONVERSATION_KINDS)),
)


def string_field(record: dict[str, Any], keys: tuple[str, ...], where: str, what: str,
                 owner: str = "a preference pair") -> str:
    """The first of `keys` that `record` holds, a string; `owner`: what the record is, for
    the error when none is."""
    for key in keys:
        value = record.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise UserError(
                    f"the {what} field `{key}` must be a string, found {type(value).__name__}.",
                    where=where, fix="store the text as a string.")
            return value
    names = " or ".join(f"`{k}`" for k in keys)
    raise UserError(f"{owner} has no {what} ({names} is missing or null).",
                    where=where, fix=f"give every record a string {names}, or drop the record.")


def pair_texts(record: dict[str, Any], type_: str, where: str, *,
               tok: PreTrainedTokenizerBase, messages_field: str = "messages",
               chosen_field: str = "chosen", rejected_field: str = "rejected",
               template: str | None = None,
               drop_system: bool = False) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of one record of a preference type (`drop_system`:
    bradley_terry.chat_template leaves the record's system text out)."""
    if type_ == "preference":  # TRL's standard text format
        return tuple(string_field(record, (k,), where, k) for k in ("prompt", "chosen", "rejected"))
    if type_ == "chat_template.default":
        return _chat_template_texts(record, where, tok, messages_field, chosen_field,
                                    rejected_field, template)
    if type_ == "chat_template.argilla":
        return _rendered_pair(*_argilla_conversation(record, where), where, tok, template)
    if type_ == "bradley_terry.chat_template":  # Axolotl's reward-model type
        system = None if drop_system else record.get("system")
        messages = [{"role": "system", "content": system}] if system else []
        prompt = string_field(record, ("input",), where, "input")
        messages.append({"role": "user", "content": prompt})
        answers = [string_field(record, (k,), where, k) for k in ("chosen", "rejected")]
        return _rendered_pair(messages, answers, where, tok, template)
    style, kind = type_.split(".")
    system_block, user_block, end = TEMPLATES[style]
    if kind in _CONVERSATION_KINDS:
        chosen = _turn(record, "chosen", 1, where)
        rejected = _turn(record, "rejected", 1, where)
        question = (_turn(record, "chosen", 0, where) if kind == "argilla_chat"
                    else string_field(record, ("prompt",), where, "prompt"))
    else:
        prompt_keys, chosen_keys, rejected_keys = _FIELDS[kind]
        question = string_field(record, prompt_keys, where, "prompt")
        chosen = string_field(record, chosen_keys, where, "chosen")
        rejected = string_field(record, rejected_keys, where, "rejected")
    system = record.get("system") if kind != "argilla_chat" else None
    prompt = (system_block.format(system=system) if system else "") + user_block.format(
        prompt=question)
    return prompt, chosen + end, rejected + end


def _turn(record: dict[str, Any], key: str, index: int, where: str) -> str:
    """The content of turn `index` of the conversation in `key` (0: user, 1: assistant)."""
    turns = record.get(key)
    content = (turns[index].get("content") if isinstance(turns, list) and len(turns) > index
               and isinstance(turns[index], dict) else None)
    if not isinstance(content, str):
        raise UserError(f"`{key}` must be a conversation whose turn {index + 1} has a string "
                        "`content`.", where=where,
                        fix=f"give `{key}` as [{{role: user, content: ...}}, {{role: assistant, "
                        "content: ...}}].")
    return content


def _chat_template_texts(record: dict[str, Any], where: str, tok: PreTrainedTokenizerBase,
                         messages_field: str, chosen_field: str, rejected_field: str,
                         template: str | None) -> tuple[str, str, str]:
    messages = record.get(messages_field)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"a preference pair has no conversation in `{messages_field}`.",
                        where=where, fix="set `field_messages` to the column holding the prompt "
                        "turns, a list of {role, content} messages.")
    answers = []
    for key in (chosen_field, rejected_field):
        answer = record.get(key)
        if isinstance(answer, dict):
            answer = answer.get("content")
        if not isinstance(answer, str):
            raise UserError(f"a preference pair has no answer in `{key}` (a message or a "
                            "string).", where=where,
                            fix="set `field_chosen` / `field_rejected` to the columns holding "
                            "the two assistant answers.")
        answers.append(answer)
    return _rendered_pair(messages, answers, where, tok, template)


def _argilla_conversation(record: dict[str, Any], where: str,
                          ) -> tuple[list[dict[str, str]], list[str]]:
    """Axolotl's `chat_template.argilla` (its ORPO type): `chosen` and `rejected` are
    conversations ending in the assistant's answer; the prompt turns are the chosen
    conversation's before it (the user turns replaced by `prompt` when given), after an
    optional `system`."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if not (isinstance(chosen, list) and isinstance(rejected, list) and len(chosen) >= 2
            and len(chosen) % 2 == 0 and rejected and all(
                isinstance(t, dict) and isinstance(t.get("content"), str)
                for t in (*chosen, rejected[-1]))):
        raise UserError("`chosen` and `rejected` must be conversations of {role, content} "
                        "turns, user and assistant alternating, each ending with the "
                        "assistant's answer.", where=where,
                        fix="give both as [{role: user, content: ...}, {role: assistant, "
                        "content: ...}, ...].")
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    prompt = record.get("prompt")
    for i, turn in enumerate(chosen[:-1]):
        user = i % 2 == 0
        content = prompt if user and isinstance(prompt, str) else turn["content"]
        messages.append({"role": "user" if user else "assistant", "content": content})
    return messages, [chosen[-1]["content"], rejected[-1]["content"]]


def _rendered_pair(messages: list[dict[str, str]], answers: list[str], where: str,
                   tok: PreTrainedTokenizerBase, template: str | None) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text: the prompt turns rendered with the chat template and
    the opening of the assistant's turn, each answer as the template renders it after them."""
    prompt = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                     add_generation_prompt=True)
    texts = []
    for answer in answers:
        full = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": answer}], chat_template=template,
            tokenize=False)
        if not full.startswith(prompt):
            raise UserError("the chat template renders the prompt differently when an answer "
                            "follows it, so the answer's tokens cannot be told apart.",
                            where=where, fix="use a template that renders the prompt turns "
                            "the same way with and without the assistant's answer.")
        texts.append(full[len(prompt):])
    return prompt, texts[0], texts[1]


def pair_sample(tok: PreTrainedTokenizerBase, prompt: str, chosen: str, rejected: str,
                share_prompt: bool = False) -> tuple[list[int], list[int], list[int], str]:
    """(input_ids, labels, position_ids, why skipped or "") of one pair: both sequences.

    `share_prompt` (`prefix_sharing`): the rejected sequence keeps only the prompt's last
    token before its answer, positions going on from the prompt's; attention takes it as a
    branch of the chosen sequence's first prompt tokens (`parallel.sharding.SPMeta.prefixes`).
    That last token is kept in both: its two copies predict the two answers' first tokens."""
    eos = tok.eos_token
    if eos:
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
    prompt_ids = list(tok(prompt)["input_ids"])
    with_chosen = list(tok(prompt + chosen)["input_ids"])
    with_rejected = list(tok(prompt + rejected)["input_ids"])
    start = min(len(commonprefix([prompt_ids, with_chosen])),
                len(commonprefix([prompt_ids, with_rejected])))
    if with_chosen[start:] == with_rejected[start:]:
        return [], [], [], "chosen identical to rejected"
    ids, labels, positions = [], [], []
    for i, full in enumerate((with_chosen, with_rejected)):
        if len(full) == start:
            return [], [], [], "empty answer"
        # The rejected sequence from the prompt's last token when it shares the prompt.
        first = start - 1 if share_prompt and i == 1 and start > 1 else 0
        ids += full[first:]
        labels += [IGNORE_INDEX] * (start - first) + full[start:]
        positions += list(range(first, len(full)))
    return ids, labels, positions, ""


def orpo_pair_sample(tok: PreTrainedTokenizerBase, prompt: str, chosen: str, rejected: str,
                     ) -> tuple[list[int], list[int], list[int], str]:
    """`pair_sample` as TRL's `ORPOTrainer.tokenize_row` tokenizes a pair: each answer's
    sequence is `prompt + answer` tokenized whole without special tokens, its prompt part the
    prompt's own tokens (one fewer when the last one merged with the answer's first), the
    bos id before it (when the tokenizer has one and it is not there) and the eos id after
    the answer (when it does not end with it)."""
    prompt_ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    sequences = []
    for answer in (chosen, rejected):
        full = list(tok(prompt + answer, add_special_tokens=False)["input_ids"])
        start = len(prompt_ids) - (full[: len(prompt_ids)] != prompt_ids)
        head, tail = full[:start], full[start:]
        if tok.bos_token_id is not None and (not head or head[0] != tok.bos_token_id):
            head = [tok.bos_token_id, *head]
        if not tail or tail[-1] != tok.eos_token_id:
            tail = [*tail, tok.eos_token_id]
        sequences.append((head, tail))
    (chosen_head, chosen_tail), (rejected_head, rejected_tail) = sequences
    differing = sum(a != b for a, b in zip(chosen_head, rejected_head, strict=False))
    if differing > 1 or abs(len(chosen_head) - len(rejected_head)) > 1:
        return [], [], [], "prompt tokenized differently before the two answers"
    if chosen_head + chosen_tail == rejected_head + rejected_tail:
        return [], [], [], "chosen identical to rejected"
    ids, labels, positions = [], [], []
    for head, tail in sequences:
        ids += head + tail
        labels += [IGNORE_INDEX] * len(head) + tail
        positions += list(range(len(head) + len(tail)))
    return ids, labels, positions, ""

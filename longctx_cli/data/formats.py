"""Per-type tokenization: raw records -> samples with `input_ids`, `labels`, `position_ids`.

A *sample* is one document (or, for `pretrain`, one piece of the concatenated stream that
may hold several document fragments). Labels are aligned with `input_ids` (Hugging Face
convention; the trainer shifts) and are -100 where no loss is wanted. The -100 on the first
token of every document is applied later, when rows are built (`pack.py`), in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dc_field
from os.path import commonprefix  # any two sequences, not only paths
from typing import TYPE_CHECKING, Any

from longctx_cli.config.sections.data import is_preference_type
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import preference
from longctx_cli.data.mistral_tokenizer import chat_ids as mistral_chat_ids
from longctx_cli.data.mistral_tokenizer import is_mistral_common
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def pretrain_batch(
    batch: dict[str, list], indices: list[int], *, tok: PreTrainedTokenizerBase, field: str,
    where: Where,
) -> dict[str, list]:
    """`pretrain`, step 1: each document's ids; `pretrain_pieces` then cuts the stream.

    A long document is never cut: it is never too long here, it spans several pieces.
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


# ---- one entry point for the tokenize map ------------------------------------------------


@dataclass
class FormatSpec:
    """What a dataset entry needs to turn its records into samples (picklable for workers)."""

    type: str
    field: str = "text"
    train_on_inputs: bool = False
    # chat_template
    messages_field: str = "messages"
    mappings: dict[str, str] = dc_field(default_factory=lambda: {"role": "role",
                                                                 "content": "content"})
    training_keys: tuple[str, ...] = ("training", "train")
    roles: dict[str, str] = dc_field(default_factory=lambda: dict(DEFAULT_ROLES))
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"
    template: str = ""
    end_markers: tuple[str, ...] = ()
    thinking_key: str | None = None  # message key of a reasoning trace, trained with content
    drop_system: bool = False  # leave out a first system turn (`drop_system_message`)
    # preference types: the answer columns of chat_template.default
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    orpo: bool = False  # pairs tokenized as TRL's ORPOTrainer does (`rl: orpo`)
    share_prompt: bool = False  # a pair's prompt once, both answers after it (prefix_sharing)

    @property
    def columns(self) -> tuple[str, ...]:
        """Columns every record must have."""
        if is_preference_type(self.type):
            return ()  # which of several names a pair uses is read per record
        if self.type == "chat_template":
            return (self.messages_field,)
        if self.type in ("completion", "pretrain"):
            return (self.field,)
        if self.type == "input_output":
            return ("segments",)
        return ("instruction", "output")  # alpaca family


# Source role names -> template roles when `roles:` is not given (Axolotl's defaults).
DEFAULT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "system": "system", "tool": "tool"}


def tokenize_batch(
    batch: dict[str, list], indices: list[int], *, spec: FormatSpec,
    tok: PreTrainedTokenizerBase, where: Where, max_chars: int | None = None,
) -> dict[str, list]:
    """Samples of a batch of records: `input_ids`, `labels`, `position_ids` and `skip` (why a
    record gave no sample, else ""); `pretrain` gives `input_ids` and `skip` only.

    A record whose texts hold more than `max_chars` characters is cut to that size before
    tokenizing (`cut_record`); its sample is still over sequence_len, so
    `excess_length_strategy` drops, truncates or reports it as usual.
    """
    if spec.type == "pretrain":
        docs = pretrain_batch(batch, indices, tok=tok, field=spec.field, where=where)
        docs["skip"] = ["" if ids else "empty text" for ids in docs["input_ids"]]
        return docs
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "skip": []}
    records = [{k: batch[k][n] for k in batch} for n in range(len(indices))]
    for record, i in zip(records, indices, strict=True):
        chars = record_chars(record, spec)
        cut = max_chars is not None and chars > max_chars
        if cut:
            record = cut_record(record, spec, max_chars)
        positions = None  # from 0 for the whole sample, except for a pair's two sequences
        if is_preference_type(spec.type):
            texts = preference.pair_texts(record, spec.type, where(i), tok=tok,
                                          drop_system=spec.drop_system,
                                          messages_field=spec.messages_field,
                                          chosen_field=spec.chosen_field,
                                          rejected_field=spec.rejected_field,
                                          template=spec.template or None)
            if spec.orpo:
                ids, labels, positions, skip = preference.orpo_pair_sample(tok, *texts)
            else:
                ids, labels, positions, skip = preference.pair_sample(
                    tok, *texts, share_prompt=spec.share_prompt)
        else:
            ids, labels, skip = _one_record(record, spec, tok, where(i))
        if cut and not skip:
            _check_cut(ids, chars, max_chars, where(i))
        if skip:
            ids, labels = [], []
        elif all(label == IGNORE_INDEX for label in labels):
            ids, labels, skip = [], [], "no target tokens"
        _append(out, ids, labels, positions if ids else None)
        out["skip"].append(skip)
    return out


def _texts(record: dict[str, Any], spec: FormatSpec) -> list[tuple[Any, Any]]:
    """(container, key) of every text a record renders, in rendering order."""
    if spec.type == "completion":
        return [(record, spec.field)]
    if spec.type == "input_output":
        segments = record.get("segments")
        return [(s, "text") for s in segments if isinstance(s, dict)] if isinstance(
            segments, list) else []
    if is_preference_type(spec.type):
        return [(record, k) for k, v in record.items() if isinstance(v, str)]
    if spec.type == "chat_template":
        turns = record.get(spec.messages_field)
        content = spec.mappings.get("content", "content")
        return [(t, content) for t in turns if isinstance(t, dict)] if isinstance(
            turns, list) else []
    return [(record, k) for k in ("system", "instruction", "input", "output") if k in record]


def record_chars(record: dict[str, Any], spec: FormatSpec) -> int:
    """Characters of text in one record (what tokenizing it costs, roughly)."""
    return sum(len(c[k]) for c, k in _texts(record, spec) if isinstance(c.get(k), str))


def cut_record(record: dict[str, Any], spec: FormatSpec, max_chars: int) -> dict[str, Any]:
    """A copy of the record whose texts hold at most `max_chars` characters in rendering order.

    Every non-empty text keeps at least one character, so the cut never turns a record into
    an "empty turn" or "empty output" one: it stays a record that is too long.
    """
    import copy

    record = copy.deepcopy(record)
    left = max_chars
    for container, key in _texts(record, spec):
        text = container.get(key)
        if isinstance(text, str) and text:
            container[key] = text[: max(left, 1)]
            left -= len(container[key])
    return record


def _one_record(
    record: dict[str, Any], spec: FormatSpec, tok: PreTrainedTokenizerBase, where: str
) -> tuple[list[int], list[int], str]:
    if spec.type == "completion":
        text = _text(record[spec.field], spec.field, where)
        if not text.strip():
            return [], [], "empty text"
        ids = encode_document(tok, text)
        return ids, list(ids), ""
    if spec.type == "input_output":
        return input_output(record, spec, tok, where)
    if spec.type == "chat_template":
        return chat(record, spec, tok, where)

    return alpaca(record, spec, tok, where)


def _required_text(record: dict[str, Any], key: str, where: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None:
        if optional:
            return ""
        raise UserError(f"record has no `{key}` (null or missing).", where=where,
                        fix=f"give every record a string `{key}`, or drop the record.")
    return _text(value, key, where)


def bos_prefix(tok: PreTrainedTokenizerBase) -> list[int]:
    """[bos] when the tokenizer puts one in front of a text on its own (Llama does, GPT-2 not),
    else nothing."""
    bos = tok.bos_token_id
    if bos is None:
        return []
    ids = tok("a")["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def text_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of `text` alone, with no special tokens added."""
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


# ---- alpaca ------------------------------------------------------------------------------

# Axolotl's alpaca prompt wording (users' checkpoints were trained on exactly these strings):
# per style, (turn with input, turn without input, system wrapper).
ALPACA_STYLES = {
    "instruct": ("### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n", "{system}\n\n"),
    "chat": ("USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:",
             "SYSTEM: {system}\n"),
    "chatml": ("<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>system\n{system}<|im_end|>\n"),
    "phi": ("<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n", "<|system|>\n{system}<|end|>\n"),
}
ALPACA_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.",
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.",
)
# type -> (style, system prompt source: "default", "none" or "record")
ALPACA_TYPES = {
    "alpaca": ("instruct", "default"), "alpaca_instruct": ("instruct", "default"),
    "alpaca:chat": ("chat", "default"), "alpaca_chat": ("chat", "default"),
    "alpaca:chatml": ("chatml", "default"), "alpaca:phi": ("phi", "default"),
    "alpaca_instruct.load_no_prompt": ("instruct", "none"),
    "alpaca_w_system": ("chat", "record"), "alpaca_w_system.load_chat": ("chat", "record"),
    "alpaca_w_system.load_instruct": ("instruct", "record"),
}


def alpaca_prompt(type_: str, instruction: str, input_: str, system: str = "") -> str:
    """The prompt text (everything before the response) of one alpaca record."""
    style, system_source = ALPACA_TYPES[type_]
    with_input, without_input, system_format = ALPACA_STYLES[style]
    if system_source == "default":
        system = ALPACA_SYSTEM[0] if input_ else ALPACA_SYSTEM[1]
    elif system_source == "none":
        system = ""
    head = system_format.format(system=system) if system else ""
    if input_:
        return head + with_input.format(instruction=instruction, input=input_)
    return head + without_input.format(instruction=instruction)


def alpaca(
    record: dict[str, Any], spec: FormatSpec, tok: PreTrainedTokenizerBase, where: str
) -> tuple[list[int], list[int], str]:
    """bos + prompt, then the output + eos; only the output and eos are targets unless
    `train_on_inputs`. A record with an empty output has nothing to learn: skipped."""
    instruction = _required_text(record, "instruction", where)
    output = _required_text(record, "output", where)
    input_ = _required_text(record, "input", where, optional=True)
    system = _required_text(record, "system", where, optional=True)
    if not output.strip():
        return [], [], "empty output"
    prompt = bos_prefix(tok) + text_ids(tok, alpaca_prompt(spec.type, instruction, input_, system))
    reply = text_ids(tok, output)
    if tok.eos_token_id is not None:
        reply.append(tok.eos_token_id)
    prompt_labels = list(prompt) if spec.train_on_inputs else [IGNORE_INDEX] * len(prompt)
    return prompt + reply, prompt_labels + reply, ""


# ---- input_output ------------------------------------------------------------------------


def input_output(
    record: dict[str, Any], spec: FormatSpec, tok: PreTrainedTokenizerBase, where: str
) -> tuple[list[int], list[int], str]:
    """`segments`: each `text` tokenized on its own (no special tokens added, as in Axolotl:
    put bos/eos in the text where you want them); `label: true` segments are targets."""
    segments = record.get("segments")
    if not isinstance(segments, list):
        raise UserError(
            f"`segments` must be a list of {{text, label}}, found {_kind(segments)}.",
            where=where, fix='write {"segments": [{"label": false, "text": "..."}, ...]}.')
    ids: list[int] = []
    labels: list[int] = []
    for n, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str) or not isinstance(
                seg.get("label"), bool):
            raise UserError(
                f"segment {n} must have a string `text` and a boolean `label`, found "
                f"{seg!r:.80}.", where=where,
                fix='write each segment as {"label": true, "text": "..."}.')
        piece = text_ids(tok, seg["text"])
        ids += piece
        labels += piece if seg["label"] or spec.train_on_inputs else [IGNORE_INDEX] * len(piece)
    if not ids:
        return [], [], "empty text"
    return ids, labels, ""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---- chat_template -----------------------------------------------------------------------


@dataclass
class Turn:
    role: str
    content: str
    train: bool
    extra: dict[str, Any] = dc_field(default_factory=dict)

    def message(self, content: str | None = None) -> dict[str, Any]:
        return {**self.extra, "role": self.role,
                "content": self.content if content is None else content}


def chat(
    record: dict[str, Any], spec: FormatSpec, tok: PreTrainedTokenizerBase, where: str
) -> tuple[list[int], list[int], str]:
    """Render the conversation once; targets are located on that text by offsets (below)."""
    turns = conversation(record, spec, where)
    if any(not t.content.strip() for t in turns):
        return [], [], "empty turn"
    first = next((t for t in turns if t.role != "system"), None)
    if first is None:
        return [], [], "no target tokens"
    if first.role == "assistant":
        return [], [], "starts with an assistant turn"
    if is_mistral_common(tok):  # encoded by mistral-common itself, targets located on ids
        return mistral_chat_ids(tok, spec.train_on_eos, turns, where)
    text, spans = chat_target_spans(tok, spec, turns, where)
    return encode_spans(tok, text, spans)


def conversation(record: dict[str, Any], spec: FormatSpec, where: str) -> list[Turn]:
    """The record's turns with roles mapped and the per-turn training decision made."""
    value = record.get(spec.messages_field)
    if not isinstance(value, list) or not value:
        raise UserError(
            f"field `{spec.messages_field}` must be a non-empty list of turns, found "
            f"{_kind(value) if value != [] else 'an empty list'}.",
            where=where,
            fix='write it as [{"role": "user", "content": "..."}, {"role": "assistant", '
            '"content": "..."}] (or map your keys with `message_property_mappings`).')
    known = set(spec.roles.values()) | {"system", "user", "assistant", "tool"}
    role_key, content_key = spec.mappings["role"], spec.mappings["content"]
    turns = []
    for n, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise UserError(f"turn {n} of `{spec.messages_field}` is {_kind(raw)}, not a "
                            "mapping.", where=where, fix="write each turn as a JSON object.")
        for key in (role_key, content_key):
            if raw.get(key) is None:
                raise UserError(
                    f"turn {n} of `{spec.messages_field}` has no `{key}` (keys: "
                    f"{', '.join(k for k, v in raw.items() if v is not None)}).",
                    where=where,
                    fix="map your keys, e.g. `message_property_mappings: {role: from, content: "
                    "value}` for ShareGPT data.")
        source_role, content = raw[role_key], raw[content_key]
        if not isinstance(source_role, str) or not isinstance(content, str):
            bad = role_key if not isinstance(source_role, str) else content_key
            raise UserError(f"turn {n} of `{spec.messages_field}`: `{bad}` must be a string, "
                            f"found {_kind(raw[bad])}.", where=where,
                            fix="give every turn's role and text as strings.")
        role = spec.roles.get(source_role, source_role)
        if role not in known:
            raise UserError(
                f"turn {n} of `{spec.messages_field}` has unknown role {source_role!r}.",
                where=where,
                fix=f"use one of {', '.join(sorted(known | set(spec.roles)))}, or map it with "
                "`roles:` (e.g. `roles: {assistant: [bot]}`).")
        flag = next((raw[k] for k in spec.training_keys if raw.get(k) is not None), None)
        if flag is not None and not isinstance(flag, bool):
            raise UserError(f"turn {n}: the training flag must be true/false, found "
                            f"{flag!r:.40}.", where=where, fix="write true or false.")
        train = flag if flag is not None else (
            spec.train_on_inputs or role in spec.roles_to_train)
        extra = {k: raw[v] for k, v in spec.mappings.items()
                 if k not in ("role", "content") and raw.get(v) is not None}
        turns.append(Turn(role, content, train, extra))
    if spec.drop_system and turns[0].role == "system":  # only a first one, as Axolotl does
        turns = turns[1:]
    return turns


# Stand-ins for a turn's content while locating it: private-use characters no template
# trims, escapes or branches on, and that differ from each other in exactly one character.
_PROBES = ("\ue000", "\ue001")


def chat_target_spans(
    tok: PreTrainedTokenizerBase, spec: FormatSpec, turns: list[Turn], where: str,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its targets.

    A turn's content is located by rendering the whole conversation twice more with that
    content replaced by two different one-character probes: the text before and after the
    probe is the template's own text around the content, whatever the template is (it need
    not render a conversation's start as the start of the whole, as Qwen3's does not). The
    end-of-turn marker is the template's marker when it directly follows the content.
    """
    messages = [t.message() for t in turns]
    full = _render(tok, spec.template, messages, where)
    trained = [n for n, t in enumerate(turns) if t.train]
    marker_turns = {"turn": trained, "last": trained[-1:], "all": range(len(turns)),
                    "none": []}[spec.train_on_eos]
    spans: list[tuple[int, int]] = []
    for n in sorted(set(trained) | set(marker_turns)):
        start, end = _locate(tok, spec.template, messages, n, full, where)
        if n in trained:
            spans.append((start, end))
            if spec.thinking_key and messages[n].get(spec.thinking_key):
                # A reasoning trace the template renders is the turn's output too: train from
                # its start (templates that drop older traces render none to locate).
                think = _locate(tok, spec.template, messages, n, full, where,
                                key=spec.thinking_key)
                if think is not None:
                    spans.append((min(think[0], start), max(think[1], end)))
        if n in marker_turns:
            rest = full[end:]
            gap = len(rest) - len(rest.lstrip(" \t\n"))
            marker = next((m for m in spec.end_markers if rest[gap:].startswith(m)), None)
            if marker:
                spans.append((end + gap, end + gap + len(marker)))
    return full, _merge(spans)


def _locate(
    tok: PreTrainedTokenizerBase, template: str, messages: list[dict], n: int, full: str,
    where: str, key: str = "content",
) -> tuple[int, int] | None:
    """Character span of turn `n`'s `key` in `full`; None when the template does not render
    that key (only asked for keys other than content)."""
    a, b = (_render(tok, template, [*messages[:n], {**messages[n], key: p},
                                    *messages[n + 1:]], where) for p in _PROBES)
    if a == b and key != "content":
        return None
    head = len(commonprefix([a, b]))
    tail = len(a) - head - 1
    ok = (len(a) == len(b) and a[head + 1:] == b[head + 1:] and full.startswith(a[:head])
          and full.endswith(a[head + 1:]) and len(full) >= head + tail)
    if not ok:
        raise UserError(
            f"cannot locate turn {n} in the rendered conversation: the chat template changes "
            "its text around the turn depending on the content.",
            where=where,
            fix="use a template that inserts each turn's content as is (e.g. `chat_template: "
            "chatml`), or pre-render the text and use `type: input_output`.")
    return head, len(full) - tail


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


def encode_spans(
    tok: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]]
) -> tuple[list[int], list[int], str]:
    """Token ids of `text` and labels: a token is a target when its characters overlap a span.

    Fast tokenizers tokenize the whole text once and give each token's character offsets;
    others (the byte tokenizer) tokenize the pieces between span boundaries one by one, so
    every token lies wholly inside or outside a span.
    """
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        labels = [t if _overlaps(s, e, spans) else IGNORE_INDEX
                  for t, (s, e) in zip(ids, enc["offset_mapping"], strict=True)]
        return ids, labels, ""
    ids, labels, cursor = [], [], 0
    for start, end in spans:
        before = text_ids(tok, text[cursor:start])
        inside = text_ids(tok, text[start:end])
        ids += before + inside
        labels += [IGNORE_INDEX] * len(before) + inside
        cursor = end
    rest = text_ids(tok, text[cursor:])
    return ids + rest, labels + [IGNORE_INDEX] * len(rest), ""


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < e and end > s for s, e in spans)


def _render(tok: PreTrainedTokenizerBase, template: str, messages: list[dict],
            where: str) -> str:
    try:
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - jinja templates raise anything; it is the data's fault
        raise UserError(
            f"the chat template rejected this conversation: {exc}",
            where=where,
            fix="check the roles and turn order the chat template expects.",
        ) from None


def _append(out: dict[str, list], ids: list[int], labels: list[int],
            positions: list[int] | None = None) -> None:
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out["position_ids"].append(list(range(len(ids))) if positions is None else positions)


def render_chat(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], where: str
) -> tuple[list[int], list[int]]:
    """Ids and labels of a conversation in the tokenizer's own template, assistant replies and
    the eos right after them as targets (the defaults of a `chat_template` entry)."""
    spec = FormatSpec("chat_template", template=tok.chat_template or "",
                      end_markers=(tok.eos_token,) if tok.eos_token else ())
    turns = [Turn(m["role"], m["content"], m["role"] == "assistant") for m in messages]
    text, spans = chat_target_spans(tok, spec, turns, where)
    ids, labels, _ = encode_spans(tok, text, spans)
    return ids, labels

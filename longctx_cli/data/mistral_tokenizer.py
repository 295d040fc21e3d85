"""`tokenizer_use_mistral_common: true`: Mistral's own tokenizer (the `mistral-common` package)
through transformers' `MistralCommonBackend`, and conversations encoded by it.

mistral-common encodes a conversation straight to tokens (its control tokens are never
written as text), so a chat's targets are located on tokens, not on rendered text: each
trained turn is encoded twice more with its content replaced by two one-token probes, and the
tokens before and after the probe are mistral-common's own around that content (the same
idea as `formats.chat_target_spans`, on ids). The ids are exactly mistral-common's
`encode_chat_completion` of the conversation, in its fine-tuning mode.
"""

from __future__ import annotations

from os.path import commonprefix
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


INSTALL_FIX = "install it with `pip install 'longctx[mistral]'` (or `pip install mistral-common`)"
# Stand-ins for a turn's content: one token each in Tekken and SentencePiece vocabularies,
# different in their only token.
_PROBES = ("0", "1")


def is_mistral_common(tok: Any) -> bool:
    """The tokenizer is transformers' wrapper of a mistral-common tokenizer."""
    return type(tok).__name__ == "MistralCommonBackend"


def load_mistral_common(source: str, local_only: bool) -> PreTrainedTokenizerBase:
    """The mistral-common tokenizer of `source` (a folder with `tekken.json` or
    `tokenizer.model.v*`, or a hub id), in fine-tuning mode."""
    from transformers.utils.import_utils import is_mistral_common_available

    if not is_mistral_common_available():
        raise UserError(
            "`tokenizer_use_mistral_common: true` needs the mistral-common package (with "
            "Pillow), which is not installed in this environment.",
            where="tokenizer_use_mistral_common",
            fix=f"{INSTALL_FIX}, or drop the key to use the model's Hugging Face tokenizer.",
        )
    from transformers.tokenization_mistral_common import MistralCommonBackend

    try:
        return MistralCommonBackend.from_pretrained(source, mode="finetuning",
                                                    local_files_only=local_only)
    except (OSError, ValueError) as exc:  # no tokenizer file in the folder / on the hub
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = "a folder" if Path(source).expanduser().is_dir() else "the hub id"
        raise UserError(
            f"could not load the mistral-common tokenizer of {source!r} ({where}): {first}",
            where="tokenizer",
            fix="point `tokenizer` (or `base_model`) at a folder holding mistral-common's "
            "`tekken.json` or `tokenizer.model.v*` file, or drop `tokenizer_use_mistral_common`.",
        ) from exc


def _encode(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str) -> list[int]:
    try:
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    except Exception as exc:  # noqa: BLE001 - mistral-common's validators raise their own types
        raise UserError(
            f"mistral-common rejected this conversation: {exc}",
            where=where,
            fix="give the turns in the order mistral-common's fine-tuning mode takes (an "
            "optional system turn, then user and assistant turns, ending with an assistant "
            "turn).",
        ) from None


class ChatTurn(Protocol):
    """A conversation's turn as the chat formats hold it (data/formats.py's `Turn`)."""

    train: bool

    def message(self) -> dict[str, Any]: ...


def chat_ids(
    tok: PreTrainedTokenizerBase, train_on_eos: str, turns: list[ChatTurn], where: str
) -> tuple[list[int], list[int], str]:
    """Ids and labels of a conversation encoded by mistral-common: a token is a target when
    it is a trained turn's content, or the eos right after it for the turns `train_on_eos`
    names."""
    messages = [t.message() for t in turns]
    full = _encode(tok, messages, where)
    trained = [n for n, t in enumerate(turns) if t.train]
    marker_turns = {"turn": trained, "last": trained[-1:], "all": range(len(turns)),
                    "none": []}[train_on_eos]
    target = [False] * len(full)
    for n in sorted(set(trained) | set(marker_turns)):
        start, end = _locate(tok, messages, n, full, where)
        if n in trained:
            target[start:end] = [True] * (end - start)
        if n in marker_turns and end < len(full) and full[end] == tok.eos_token_id:
            target[end] = True
    return full, [t if on else IGNORE_INDEX for t, on in zip(full, target, strict=True)], ""


def _locate(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], n: int,
            full: list[int], where: str) -> tuple[int, int]:
    """Token span of turn `n`'s content in `full`."""
    probes = [tok.encode(p, add_special_tokens=False) for p in _PROBES]
    a, b = (_encode(tok, [*messages[:n], {**messages[n], "content": p}, *messages[n + 1:]],
                    where) for p in _PROBES)
    head = len(commonprefix([a, b]))
    tail = len(commonprefix([a[::-1], b[::-1]]))
    # The probes' tokens stand alone between the two (none merged with the text around them),
    # and the conversation has the same tokens before and after its own content.
    ok = (a[head:len(a) - tail] == probes[0] and b[head:len(b) - tail] == probes[1]
          and full[:head] == a[:head] and len(full) >= head + tail
          and full[len(full) - tail:] == a[len(a) - tail:])
    if not ok:
        raise UserError(
            f"cannot locate turn {n} in mistral-common's encoding of the conversation: its "
            "tokens merge with the text mistral-common puts around them (e.g. a system prompt "
            "it prepends to that turn).",
            where=where,
            fix="train on assistant turns only (`roles_to_train: [assistant]`, no "
            "`train_on_inputs`), or drop `tokenizer_use_mistral_common`.",
        )
    return head, len(full) - tail

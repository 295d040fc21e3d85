"""KTO examples (`rl: kto`): one record -> a prompt, a completion and its label; a micro-batch's
examples -> KTO samples, each the example's sequence and its mismatched KL sequence.

The record types are Axolotl's KTO types (`chatml.*`, `llama3.*`: argilla, argilla_chat,
intel, prompt_pairs, ultra), whose prompt strings are the same chat blocks as its preference
types (`data/preference.py`), and `kto`, TRL's own unpaired format (`prompt`, `completion`,
`label`, the prompt already rendered). `label` is the completion's desirability.

Tokenization is TRL's (`KTOTrainer`): an eos appended to a completion that does not end with
one, `prompt` and `prompt + completion` tokenized whole, the completion starting where the two
token lists first differ. TRL's KL reference point reads mismatched sequences: within each
chunk of `per_device_train_batch_size` consecutive examples (in dataset order, which its
sequential sampler keeps), example `i`'s prompt with completion `i - 1` of the chunk (the first
example takes the chunk's last completion): `kl_completions`. A KTO sample is the two
sequences back to back, `[prompt_i + completion_i]` then `[prompt_i + completion_{i-1}]`,
positions from 0 in each, targets on the completions only; `train/objectives/kto.py` reads
document `2k` as example `k`'s completion and `2k + 1` as its KL sequence.
"""

from __future__ import annotations

from os.path import commonprefix  # any two sequences, token lists included
from typing import TYPE_CHECKING, Any

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data.preference import TEMPLATES, string_field
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# type suffix -> the record key holding the user's question (argilla_chat: a conversation)
_QUESTION_KEYS = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt",
                  "ultra": "prompt"}
_OWNER = "a KTO example"
KTO_TYPES = ("kto", *(f"{style}.{kind}" for style in TEMPLATES
                      for kind in (*_QUESTION_KEYS, "argilla_chat")))


def kto_texts(record: dict[str, Any], type_: str, where: str) -> tuple[str, str, bool]:
    """(prompt, completion, desirable) of one record of a KTO type."""
    label = record.get("label")
    if not isinstance(label, bool):
        raise UserError(f"a KTO example needs a boolean `label` (whether its completion is "
                        f"desirable), found {label!r}.", where=where,
                        fix="give every record `label: true` or `label: false`.")
    if type_ == "kto":
        return (string_field(record, ("prompt",), where, "prompt", _OWNER),
                string_field(record, ("completion",), where, "completion", _OWNER), label)
    style, kind = type_.split(".")
    system_block, user_block, end = TEMPLATES[style]
    if kind == "argilla_chat":  # `completion` is the conversation [user turn, assistant turn]
        turns = record.get("completion")
        if not (isinstance(turns, list) and len(turns) >= 2 and all(
                isinstance(t, dict) and isinstance(t.get("content"), str) for t in turns[:2])):
            raise UserError("`completion` must be a conversation [{role: user, content: ...}, "
                            "{role: assistant, content: ...}].", where=where,
                            fix="give `completion` as the user turn and the assistant's answer.")
        return user_block.format(prompt=turns[0]["content"]), turns[1]["content"] + end, label
    key = _QUESTION_KEYS[kind]
    question = string_field(record, (key,), where, key, _OWNER)
    completion = string_field(record, ("completion",), where, "completion", _OWNER)
    system = record.get("system")
    prompt = (system_block.format(system=system) if system else "") + user_block.format(
        prompt=question)
    return prompt, completion + end, label


def kto_ids(tok: PreTrainedTokenizerBase, prompt: str, completion: str,
            ) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as TRL's `KTOTrainer` tokenizes an example; the completion
    is empty when it adds no token."""
    eos = tok.eos_token
    if eos and not completion.endswith(eos):
        completion += eos
    prompt_ids = list(tok(prompt)["input_ids"])
    full = list(tok(prompt + completion)["input_ids"])
    start = len(commonprefix([prompt_ids, full]))
    return prompt_ids[:start], full[start:]


def kl_completions(completions: list[list[int]], batch: int) -> list[list[int]]:
    """TRL's KL completions: within each chunk of `batch` consecutive examples, the
    completions rotated by one (example `i` takes completion `i - 1`)."""
    rotated = []
    for start in range(0, len(completions), batch):
        chunk = completions[start:start + batch]
        rotated += chunk[-1:] + chunk[:-1]
    return rotated


def kto_sample(prompt: list[int], completion: list[int], kl_completion: list[int],
               ) -> tuple[list[int], list[int], list[int]]:
    """(input_ids, labels, position_ids) of one KTO sample: the example's sequence, then its
    KL sequence, targets on the completions only."""
    ids, labels, positions = [], [], []
    for answer in (completion, kl_completion):
        ids += prompt + answer
        labels += [IGNORE_INDEX] * len(prompt) + answer
        positions += list(range(len(prompt) + len(answer)))
    return ids, labels, positions

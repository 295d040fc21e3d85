"""KTO examples (`rl: kto`): one record -> a prompt, a completion and its label; a micro-batch's
examples -> KTO samples, each the example's sequence and its mismatched KL sequence.

The record types are Axolotl's KTO types (`chatml.*`, `llama3.*`: argilla, argilla_chat,
intel, prompt_pairs, ultra), whose prompt strings are the same chat blocks as its preference
types (`data/preference.py`); `label` is the completion's desirability.

Tokenization is TRL's (`KTOTrainer`): an eos appended to a completion that does not end with
one, `prompt` and `prompt + completion` tokenized whole, the completion starting where the two
token lists first differ. TRL's KL reference point reads mismatched sequences: within each
chunk of `per_device_train_batch_size` consecutive examples (in dataset order, which its
sequential sampler keeps), example `i`'s prompt with completion `i - 1` of the chunk (the first
example takes the chunk's last completion): `kl_completions`. A KTO sample is the two
sequences back to back, `[prompt_i + completion_i]` then `[prompt_i + completion_{i-1}]`,
positions from 0 in each, targets on the completions only; `train/objectives/kto.py` reads
document `2k` as example `k`'s completion and `2k + 1` as its KL sequence.

`kto_rows` writes one KTO sample per row with its label (`kto_label`), in the order the trainer
reads them (in order, as TRL's sequential sampler): the examples of every entry, shuffled with
the seed when `shuffle_merged_datasets` (before the rotation, as a dataset handed to TRL
would be), then rotated in chunks of `micro_batch_size`, so each micro-batch of rows is one of
TRL's batches. A chunk holding a sample longer than `sequence_len` is dropped whole (the
other examples' KL completions stay those of their chunk) and counted.
"""

from __future__ import annotations

import random
from os.path import commonprefix  # any two sequences, token lists included
from typing import TYPE_CHECKING, Any

from longctx_cli.config.sections.data import KTO_TYPES
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import load
from longctx_cli.data.preference import TEMPLATES, string_field
from longctx_cli.data.report import DatasetStats, PrepareReport, RowStats
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config

# type suffix -> the record key holding the user's question (argilla_chat: a conversation)
_QUESTION_KEYS = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt",
                  "ultra": "prompt"}
_OWNER = "a KTO example"


def kto_texts(record: dict[str, Any], type_: str, where: str) -> tuple[str, str, bool]:
    """(prompt, completion, desirable) of one record of a KTO type."""
    label = record.get("label")
    if not isinstance(label, bool):
        raise UserError(f"a KTO example needs a boolean `label` (whether its completion is "
                        f"desirable), found {label!r}.", where=where,
                        fix="give every record `label: true` or `label: false`.")
    assert type_ in KTO_TYPES, type_  # the config's rules admit no other
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


def kto_rows(config: Config, tok: PreTrainedTokenizerBase, sources: list,
             report: PrepareReport, work: str) -> Dataset:
    """The KTO rows of the train split (see the module doc): `input_ids`, `labels`,
    `position_ids` and `kto_label`."""
    from datasets import Dataset

    examples: list[tuple[list[int], list[int], bool, int]] = []  # + the entry's index
    for n, (entry, source) in enumerate(zip(config.data.datasets, sources, strict=True)):
        stats = DatasetStats(entry.path or "kto", entry.type, "train")
        report.datasets.append(stats)
        load.prescan(source)
        records = load.load_records(source, entry, cache_dir=f"{work}/hf")
        stats.records = len(records)
        if len(records) == 0:
            raise load.empty_error(source)
        for i, record in enumerate(records):
            prompt, completion, label = kto_texts(record, entry.type, source.where(i))
            prompt_ids, completion_ids = kto_ids(tok, prompt, completion)
            examples.append((prompt_ids, completion_ids, label, n))
    if config.data.shuffle_merged_datasets:
        random.Random(config.training.seed).shuffle(examples)
    batch = config.training.micro_batch_size
    kl = kl_completions([e[1] for e in examples], batch)
    columns: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [],
                                "kto_label": []}
    for start in range(0, len(examples), batch):
        chunk = [(*examples[i], kl[i]) for i in range(start, min(start + batch, len(examples)))]
        samples = [kto_sample(prompt, completion, kl_completion)
                   for prompt, completion, _, _, kl_completion in chunk]
        too_long = any(len(ids) > config.data.sequence_len for ids, _, _ in samples)
        for (*_, label, n, _), (ids, labels, positions) in zip(chunk, samples, strict=True):
            stats = report.datasets[n]
            if too_long:
                stats.too_long += len(ids) > config.data.sequence_len
                stats.dropped += 1
                continue
            stats.samples += 1
            stats.tokens += len(ids)
            stats.target_tokens += sum(t != IGNORE_INDEX for t in labels)
            for key, value in zip(columns, (ids, labels, positions, label), strict=True):
                columns[key].append(value)
    if not columns["input_ids"]:
        raise UserError(f"no KTO example is left to train on: every micro-batch of "
                        f"{batch} holds one longer than `sequence_len: "
                        f"{config.data.sequence_len}` (its two sequences together).",
                        where="datasets", fix="raise sequence_len, or shorten the data.")
    dropped = sum(s.dropped for s in report.datasets)
    if dropped:
        report.notes.append(f"{dropped} KTO example(s) dropped: their micro-batch of {batch} "
                            "held a sample longer than sequence_len.")
    report.train = RowStats(len(columns["input_ids"]), sum(s.tokens for s in report.datasets),
                            sum(s.target_tokens for s in report.datasets), 0.0)
    return Dataset.from_dict(columns)

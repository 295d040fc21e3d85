"""Prompt datasets for `rl: grpo`: each record's prompt, tokenized as TRL's `GRPOTrainer`
tokenizes it, with the record's other columns, which the reward functions receive.

A record holds a `prompt`: text (its tokens after the tokenizer's BOS, if it has one, as
`longctx generate` reads a prompt and TRL's tokenizer call gives for Llama- or Qwen-style
tokenizers; no end-of-sequence token is appended) or chat messages (rendered with the run's
chat template and its generation prompt, as TRL renders them).
An Axolotl GRPO transform (`type: module.function`) is called as Axolotl calls it,
`function(cfg)` returning `transform_fn` (or `(transform_fn, {"remove_columns": [...]})`), and
`transform_fn(record, tokenizer=...)` returns the fields that replace the record's. A prompt
that leaves no room for `trl.max_completion_length` within `sequence_len` is dropped and
counted (the report says how many).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from longctx_cli.data import chat_templates, formats, load
from longctx_cli.data.report import DatasetStats, PrepareReport, RowStats
from longctx_cli.errors import UserError
from longctx_cli.user_code import resolve_callable, source_digest

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config, DatasetConfig


def fingerprint(config: Config) -> dict[str, Any]:
    """What the prompt rows depend on besides the files and the tokenizer."""
    return {"max_completion_length": config.trl.max_completion_length if config.trl else None,
            "transforms": {e.transform: source_digest(e.transform, config.source_dir)
                           for e in config.data.datasets if e.transform}}


def prompt_rows(config: Config, tok: PreTrainedTokenizerBase, sources: list,
                report: PrepareReport, work: str) -> Dataset:
    """Every entry's prompts as rows `prompt_ids`, `prompt` (JSON), `columns` (JSON) and
    `where` (the record's file:line, for messages about it)."""
    from datasets import Dataset

    ids: list[list[int]] = []
    prompts: list[str] = []
    columns: list[str] = []
    places: list[str] = []
    room = config.data.sequence_len - config.trl.max_completion_length
    for entry, source in zip(config.data.datasets, sources, strict=True):
        stats = DatasetStats(entry.path or "prompts", entry.transform or entry.type, "train")
        report.datasets.append(stats)
        load.prescan(source)
        records = load.load_records(source, entry, cache_dir=f"{work}/hf")
        stats.records = len(records)
        if len(records) == 0:
            raise load.empty_error(source)
        transform = record_transform(entry, config, tok)
        for i, record in enumerate(records):
            fields = transform(record, i, source) if transform else dict(record)
            prompt = pop_prompt(fields, source.where(i), source.label)
            tokens = prompt_ids(tok, prompt, config, entry, source.where(i))
            if len(tokens) > room:
                stats.too_long += 1
                stats.dropped += 1
                continue
            ids.append(tokens)
            prompts.append(json.dumps(prompt))
            columns.append(json.dumps(fields, default=str))
            places.append(source.where(i))
            stats.samples += 1
            stats.tokens += len(tokens)
    if not ids:
        raise UserError(
            f"no prompt leaves room for `trl.max_completion_length: "
            f"{config.trl.max_completion_length}` within `sequence_len: "
            f"{config.data.sequence_len}` ({sum(s.dropped for s in report.datasets)} dropped).",
            where="datasets",
            fix="raise sequence_len, or lower trl.max_completion_length.")
    report.train = RowStats(len(ids), sum(map(len, ids)), 0, 0.0)
    report.prompts = True
    if report.datasets[0].dropped:
        report.notes.append(f"{sum(s.dropped for s in report.datasets)} prompt(s) longer than "
                            f"sequence_len - max_completion_length ({room}) were dropped.")
    return Dataset.from_dict({"prompt_ids": ids, "prompt": prompts, "columns": columns,
                              "where": places})


def pop_prompt(fields: dict[str, Any], where: str, label: str) -> Any:
    """The record's `prompt`, taken out of its fields."""
    if "prompt" not in fields:
        raise UserError(
            f"record {where} has no `prompt` field (fields: {', '.join(fields)}).",
            where=label,
            fix="give each record a `prompt` (text or chat messages), or name a "
            "transform that makes one (`type: module.function`).")
    return fields.pop("prompt")


def prompt_ids(tok: PreTrainedTokenizerBase, prompt: Any, config: Config,
               entry: DatasetConfig, where: str) -> list[int]:
    """The prompt's tokens (see the module doc)."""
    if isinstance(prompt, str):  # as `longctx generate` reads a prompt: BOS (if any), text
        return formats.bos_prefix(tok) + formats.text_ids(tok, prompt)
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                        for m in prompt):
        template = chat_templates.resolve_template(config, entry, tok)[0]
        rendered = tok.apply_chat_template(prompt, chat_template=template, tokenize=True,
                                           add_generation_prompt=True, return_dict=True)
        return list(rendered["input_ids"])
    raise UserError(
        f"record {where}: `prompt` is {type(prompt).__name__}, neither text nor chat messages "
        "(a list of {role, content}).",
        where=entry.path or "datasets",
        fix="write the prompt as a string or as messages.")


def record_transform(entry: DatasetConfig, config: Config, tok: PreTrainedTokenizerBase):
    """The entry's Axolotl transform as `(record, index, source) -> fields`, or None."""
    if not entry.transform:
        return None
    where = "datasets[].type"
    made = resolve_callable(entry.transform, config.source_dir, where)(config)
    function, options = made if isinstance(made, tuple) else (made, {})
    removed = set((options or {}).get("remove_columns") or ())

    def apply(record: dict, index: int, source) -> dict:
        try:
            out = function(record, tokenizer=tok)
        except Exception as e:  # the user's code may fail in any way
            raise UserError(
                f"`{entry.transform}` raised {type(e).__name__}: {e} on record "
                f"{source.where(index)}.", where=where,
                fix="fix the transform or the record.") from None
        if not isinstance(out, dict):
            raise UserError(f"`{entry.transform}` returned {type(out).__name__}, not a dict "
                            f"of fields, for record {source.where(index)}.", where=where,
                            fix="return a dict such as {'prompt': ..., 'answer': ...}.")
        return {k: v for k, v in {**record, **out}.items() if k not in removed or k in out}

    return apply

"""What `validate` reads of the data: the first records of every local dataset file, through
preprocess's own parsers and with its messages (`load.jsonl_records`, `prepare.format_spec`
and `check_columns`, `formats.tokenize_batch`, `vision.encode_vision_record`), in bounded time
and writing nothing. A problem is the UserError preprocess would raise on the same record;
otherwise one line per entry says how many records were read and what they gave.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.data import formats, load
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from longctx_cli.config.schema import Config, DatasetConfig

# Records read of each entry: all of a small file, the first ones of a large one.
TEXT_RECORDS = 1000
VISION_RECORDS = 50  # each decodes its images
_JSON_ARRAY_BYTES = 64 * 1024**2  # a .json array is parsed whole: only up to this size


def check_data(config: Config) -> list[str]:
    """One line per dataset entry read (or why it was not); the first problem of the records
    read raises the UserError preprocess raises for it."""
    lines: list[str] = []
    tok = None
    tokenizer_missing = ""
    for key, entries in (("datasets", config.data.datasets),
                         ("eval_datasets", config.data.eval_datasets)):
        for n, entry in enumerate(entries):
            if entry.type == "passkey" or not entry.path:
                continue  # generated, or streamed (`pretraining_dataset`)
            source = load.resolve(entry)
            label = f"{key}[{n}] {source.label}"
            if source.kind != "files" or source.builder != "json":
                lines.append(f"{label}: not read ({_kind(source)}: preprocess reads it)")
                continue
            limit = VISION_RECORDS if config.vision.processor_type else TEXT_RECORDS
            records, complete = _first_records(source, limit)
            if records is None:
                lines.append(f"{label}: not read (a .json array over "
                             f"{_JSON_ARRAY_BYTES // 1024**2} MiB: preprocess reads it)")
                continue
            read = f"{len(records)} records read" + ("" if complete else
                                                     f" (the first {len(records)} of more)")
            if tok is None and not tokenizer_missing:
                tok, tokenizer_missing = _tokenizer(config)
            if tok is None:
                lines.append(f"{label}: {read}, JSON checked; not tokenized "
                             f"({tokenizer_missing})")
                continue
            if config.objective.rl == "grpo":
                outcome = _prompt_records(entry, source, records, config, tok)
            elif config.vision.processor_type and entry.type == "chat_template":
                outcome = _vision_records(entry, source, records, config, tok)
            else:
                # A processor's text records read with its tokenizer (a mistral-common
                # tokenizer's own `.tokenizer` is the library's, not a processor's part).
                outcome = _text_records(entry, source, records, config,
                                        tok.tokenizer if config.vision.processor_type else tok)
            lines.append(f"{label}: {read}, {outcome}")
    return lines


def _kind(source: load.Source) -> str:
    if source.kind == "files":
        return f"{source.builder} files"
    return {"disk": "a saved dataset folder", "hub": "a hub dataset"}.get(source.kind,
                                                                           source.kind)


def _first_records(source: load.Source, limit: int
                   ) -> tuple[list[tuple[str, dict[str, Any], Path]] | None, bool]:
    """Up to `limit` records as (file:line, record, its folder), and whether that is all."""
    def every() -> Iterator[tuple[str, dict[str, Any], Path]]:
        for f in source.files:
            if load.is_jsonl(source, f):
                yield from ((f"{f}:{line}", r, f.parent) for line, r in load.jsonl_records(f))
                continue
            if f.stat().st_size > _JSON_ARRAY_BYTES:
                raise _TooLarge
            array = load.json_array(f)
            if array is None:  # JSON Lines saved as .json
                yield from ((f"{f}:{line}", r, f.parent) for line, r in load.jsonl_records(f))
            else:
                yield from ((f"{f}, record {i + 1}", r, f.parent) for i, r in enumerate(array))

    try:
        records = list(itertools.islice(every(), limit + 1))
    except _TooLarge:
        return None, False
    if not records:
        raise load.empty_error(source)
    return records[:limit], len(records) <= limit


class _TooLarge(Exception):
    pass


def _tokenizer(config: Config) -> tuple[Any, str]:
    """The run's tokenizer (a vision run's processor), or why it is not at hand: a hub
    tokenizer this machine cannot reach is not validate's to refuse (a local one is)."""
    from longctx_cli.data.tokenizer import BYTE

    source = str(config.model.tokenizer_source or "")
    local = source == BYTE or Path(source).expanduser().exists() or source.startswith(
        ("/", ".", "~"))
    try:
        if config.vision.processor_type:
            from longctx_cli.data.vision import load_config_processor

            return load_config_processor(config), ""
        from longctx_cli.data.tokenizer import load_tokenizer

        return load_tokenizer(config), ""
    except UserError as e:
        if local:
            raise
        return None, f"the tokenizer is not at hand: {e.message}"


def _text_records(entry: DatasetConfig, source: load.Source,
                  records: list[tuple[str, dict[str, Any], Path]], config: Config,
                  tok: Any) -> str:
    """Tokenize the records as preprocess does; what they gave."""
    from longctx_cli.data.prepare import check_columns, format_spec, too_long_error

    spec = format_spec(entry, config, tok)
    columns = list(dict.fromkeys(k for _, r, _ in records for k in r))
    check_columns(entry, spec, columns, source.label)
    batch = {c: [r.get(c) for _, r, _ in records] for c in columns}  # as `datasets` fills
    where = [w for w, _, _ in records]
    out = formats.tokenize_batch(batch, list(range(len(records))), spec=spec, tok=tok,
                                 where=where.__getitem__,
                                 max_chars=formats.max_record_chars(config.data.sequence_len))
    lengths = [len(ids) for ids in out["input_ids"]]
    limit, strategy = config.data.sequence_len, config.data.excess_length_strategy
    skips = list(out["skip"])
    over = [i for i, n in enumerate(lengths) if n > limit] if entry.type != "pretrain" else []
    if over and strategy == "error":
        raise too_long_error(lengths[over[0]], limit,
                             f"{len(over)} of the {len(records)} records read are",
                             where[over[0]])
    for i in over if strategy == "drop" else []:
        skips[i] = skips[i] or _DROPPED
    return _outcome(skips, sum(lengths), len(records), source)


_DROPPED = "longer than sequence_len, dropped (`excess_length_strategy: drop`)"


def _prompt_records(entry: DatasetConfig, source: load.Source,
                    records: list[tuple[str, dict[str, Any], Path]], config: Config,
                    tok: Any) -> str:
    """GRPO's prompts, through the entry's transform and tokenized as training reads them."""
    from longctx_cli.data.prompts import pop_prompt, prompt_ids, record_transform

    transform = record_transform(entry, config, tok)
    room = config.data.sequence_len - config.trl.max_completion_length
    skips, tokens = [], 0
    places = _Places([w for w, _, _ in records])
    for i, (where, record, _) in enumerate(records):
        fields = transform(record, i, places) if transform else dict(record)
        ids = prompt_ids(tok, pop_prompt(fields, where, source.label), config, entry, where)
        skips.append("" if len(ids) <= room else
                     "longer than sequence_len - trl.max_completion_length, dropped")
        tokens += len(ids)
    return _outcome(skips, tokens, len(records), source).replace("tokens", "prompt tokens", 1)


@dataclass(frozen=True)
class _Places:
    """`where(i)` of the records read, as a `load.Source` answers it (for transforms)."""

    places: list[str]

    def where(self, i: int) -> str:
        return self.places[i]


def _vision_records(entry: DatasetConfig, source: load.Source,
                    records: list[tuple[str, dict[str, Any], Path]], config: Config,
                    vp: Any) -> str:
    """Encode the records with the processor as preprocess does (images opened and decoded,
    their tokens counted against sequence_len); what they gave."""
    from longctx_cli.data import vision
    from longctx_cli.data.prepare import format_spec

    spec = format_spec(entry, config, vp.tokenizer)
    skips, tokens, images = [], 0, 0
    for where, record, base in records:
        doc = vision.encode_vision_record(dict(record), vp, where, base_dir=base, spec=spec)
        strategy, limit = config.data.excess_length_strategy, config.data.sequence_len
        if strategy == "error":
            vision.check_fits(doc, limit)
        skips.append("no target tokens" if not doc.has_targets else
                     _DROPPED if strategy == "drop" and len(doc) > limit else "")
        tokens, images = tokens + len(doc), images + len(doc.image_grid_thw)
    return _outcome(skips, tokens, len(records), source) + f", {images} images decoded"


def _outcome(skips: list[str], tokens: int, read: int, source: load.Source) -> str:
    """`N tokens` and the records that give no sample, by reason; an error where none does."""
    reasons = Counter(s for s in skips if s)
    skipped = sum(reasons.values())
    why = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
    if skipped == read:
        raise UserError(
            f"none of the {read} records read gives a sample to train on ({why}).",
            where=source.label,
            fix="check the entry's `type` and fields against the records (docs/data.md), "
            "e.g. a chat's `roles_to_train` against the roles its turns have.",
        )
    return f"{tokens:,} tokens" + (f", {skipped} give no sample ({why})" if skipped else "")

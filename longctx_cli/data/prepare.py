"""Build the prepared rows of a config: `prepare(config) -> Prepared`.

Loads each dataset entry (or generates passkey samples), tokenizes it in its format, applies
the length rules, packs the samples into rows, splits off the eval rows and writes the
report. With `processor_type` set (a vision-language run), chat records go through the
processor (`data/vision/`: images and videos become pixel patches and expanded image
tokens), every sample becomes a document, and the rows carry the vision columns of
`vision.ROW_COLUMNS` besides the text ones; a text run's rows are unchanged. Whether a
build is needed, and where and how its result is stored, is the cache's business
(`longctx_cli.data.cache`); this module only fills an entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import cache, chat_templates, formats, load, pack, passkey, vision
from longctx_cli.data.cache import (
    FINGERPRINT_FILE,
    PIPELINE_VERSION,
    Prepared,
    compute_fingerprint,
    fingerprint_parts,
)
from longctx_cli.data.report import DatasetStats, PrepareReport, RowStats, length_histogram
from longctx_cli.data.tokenizer import load_tokenizer
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config, DatasetConfig
    from longctx_cli.data.vision.processor import VisionProcessor

# The cache names are re-exported: callers import them from here.
__all__ = [
    "FINGERPRINT_FILE", "PIPELINE_VERSION", "Prepared", "PrepareReport", "compute_fingerprint",
    "fingerprint_parts", "format_spec", "prepare", "sample_segments",
]

log = logging.getLogger("longctx.data")

_CHUNK_BINS = 512  # rows assembled per read of the samples table
_VISION_CHUNK_BINS = 16  # the same with pixels in them (megabytes a row)
_VISION_BATCH = 32  # documents per write of the vision samples file


def prepare(
    config: Config,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    progress: bool = True,
    force: bool = False,
    processor: VisionProcessor | None = None,
) -> Prepared:
    """The prepared rows of `config`: from the cache when its fingerprint matches, else built.

    Run it on one process (e.g. rank 0, then a barrier): concurrent builders each write their
    own temporary folder, and only one of them ends up in place. A vision run
    (`processor_type`) uses `processor` (else the config's, loaded) and its tokenizer;
    `tokenizer` is then not used.
    """
    if not config.data.datasets and config.data.pretraining_dataset:
        raise UserError(
            "`pretraining_dataset` is streamed while training; there is nothing to preprocess.",
            where="pretraining_dataset",
            fix="run `longctx train` directly (or list the files under `datasets` with "
            "`type: pretrain` to tokenize and cache them).",
        )
    if not config.data.datasets:
        raise UserError(
            "no training datasets: `datasets` is empty.",
            where="config",
            fix="add an entry, e.g. `datasets: [{path: data.jsonl, type: completion}]`.",
        )
    vp = None
    if config.vision.processor_type:
        _check_vision_run(config)
        vp = processor if processor is not None else vision.load_config_processor(config)
        tok = vp.tokenizer
    else:
        tok = tokenizer if tokenizer is not None else load_tokenizer(config)
    train_sources = [load.source_of(e) for e in config.data.datasets]
    eval_sources = [load.source_of(e) for e in config.data.eval_datasets]
    parts = fingerprint_parts(config, tok, train_sources, eval_sources, vp)
    fp = cache.digest(parts)
    target = cache.entry_path(config.prepared_path, fp)
    reason = "rebuild forced"
    if not force:
        cached, reason = cache.find_entry(target, fp, parts)
        if cached is not None:
            log.info("reusing prepared data at %s (fingerprint %s)", target, fp)
            return cached
    log.info("preparing data into %s: %s", target, reason)

    def fill(tmp: Path) -> PrepareReport:
        started = time.monotonic()
        with _progress_bars(progress):
            report = _build(config, tok, tmp, train_sources, eval_sources, progress, vp)
        report.seconds = time.monotonic() - started
        return report

    return cache.write_entry(target, fp, parts, reason, fill)


# ---- progress ----------------------------------------------------------------------------


def _on_terminal() -> bool:
    """Progress bars only for a person watching: a log file would fill with redraws."""
    return sys.stderr.isatty()


def _say(progress: bool, message: str) -> None:
    """A plain progress line where there are no bars (output redirected to a file)."""
    if progress and not _on_terminal():
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    import datasets

    was = not datasets.are_progress_bars_disabled()
    enabled = enabled and _on_terminal()
    (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


# ---- building ----------------------------------------------------------------------------


def _row_features() -> Any:
    from datasets import Features, List, Value

    return Features({name: List(Value("int32"))
                     for name in ("input_ids", "labels", "position_ids")})


def _build(
    config: Config, tok: PreTrainedTokenizerBase, tmp: Path, train_sources: list,
    eval_sources: list, progress: bool, vp: VisionProcessor | None = None,
) -> PrepareReport:
    """Write `train/` (and `eval/`) into `tmp`; intermediate files go to `tmp/work`."""
    work = tmp / cache.SCRATCH_DIR
    work.mkdir()
    report = PrepareReport(config.data.sequence_len, config.data.sample_packing,
                           config.data.excess_length_strategy, vision=vp is not None,
                           sequential=config.data.sample_packing_sequentially)
    if config.objective.rl == "grpo":  # prompts to roll out, not packed rows
        from longctx_cli.data.prompts import prompt_rows

        prompt_rows(config, tok, train_sources, report, str(work)).save_to_disk(
            str(tmp / cache.TRAIN_DIR))
        return report
    if config.objective.rl == "kto":  # one labelled example per row, in TRL's batches
        from longctx_cli.data.kto import kto_rows

        kto_rows(config, tok, train_sources, report, str(work)).save_to_disk(
            str(tmp / cache.TRAIN_DIR))
        return report
    train_rows, hist = _split_rows("train", config.data.datasets, train_sources, config, tok, work,
                                   progress, report, vp)
    report.length_histogram = hist
    eval_rows = None
    if config.data.eval_datasets:
        eval_rows, _ = _split_rows("eval", config.data.eval_datasets, eval_sources, config, tok,
                                   work, progress, report, vp)
        if config.data.val_set_size:
            report.notes.append("val_set_size is ignored because eval_datasets is set.")
    elif config.data.val_set_size:
        train_rows, eval_rows = _hold_out(train_rows, config)
    elif config.data.shuffle_merged_datasets:
        train_rows = train_rows.shuffle(seed=config.training.seed)
    report.train = _row_stats(train_rows, config.data.sequence_len, vp)
    train_rows.save_to_disk(str(tmp / cache.TRAIN_DIR))
    if eval_rows is not None:
        report.eval = _row_stats(eval_rows, config.data.sequence_len, vp)
        eval_rows.save_to_disk(str(tmp / cache.EVAL_DIR))
    return report


def _hold_out(rows: Dataset, config: Config) -> tuple[Dataset, Dataset]:
    size = config.data.val_set_size
    n_eval = int(size) if size >= 1 else max(1, round(size * len(rows)))
    if n_eval >= len(rows):
        raise UserError(
            f"val_set_size {size:g} holds out {n_eval} of {len(rows)} rows, leaving none to "
            "train on.",
            where="val_set_size",
            fix="lower val_set_size, or add data.",
        )
    if not config.data.curriculum_sampling:
        split = rows.train_test_split(test_size=n_eval, seed=config.training.seed, shuffle=True)
        return split["train"], split["test"]
    # The same held-out rows as without it; the training rows keep their order.
    numbered = rows.add_column("_row", list(range(len(rows))))
    test = numbered.train_test_split(test_size=n_eval, seed=config.training.seed,
                                     shuffle=True)["test"]
    held = set(test["_row"])
    return rows.select([i for i in range(len(rows)) if i not in held]), test.remove_columns("_row")


def _row_stats(rows: Dataset, sequence_len: int, vp: VisionProcessor | None = None
               ) -> RowStats:
    import pyarrow.compute as pc

    table = rows.with_format("arrow")[:]
    tokens = int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0)
    labels = pc.list_flatten(table.column("labels"))
    targets = int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    stats = RowStats(len(rows), tokens, targets,
                     pack.packing_efficiency(tokens, len(rows), sequence_len))
    if vp is not None and len(rows):
        images = pc.list_value_length(table.column("image_grid_thw")).to_numpy(
            zero_copy_only=False)
        per_row = _vision_tokens_per_row(table.column("input_ids"), vp)
        stats.images, stats.max_images = int(images.sum()), int(images.max())
        stats.image_tokens, stats.max_image_tokens = int(per_row.sum()), int(per_row.max())
    return stats


def _vision_tokens_per_row(column: Any, vp: VisionProcessor) -> np.ndarray:
    """Image and video tokens of each row of an `input_ids` column (what the images cost)."""
    ids_column = column.combine_chunks()
    ids = ids_column.flatten().to_numpy(zero_copy_only=False)
    offsets = ids_column.offsets.to_numpy()
    seen = np.concatenate([[0], np.cumsum(np.isin(ids, list(vp.feature_ids().values())))])
    return seen[offsets[1:]] - seen[offsets[:-1]]


def _split_rows(
    split: str, entries: list[DatasetConfig], sources: list, config: Config,
    tok: PreTrainedTokenizerBase, work: Path, progress: bool, report: PrepareReport,
    vp: VisionProcessor | None = None,
) -> tuple[Dataset, list[tuple]]:
    """Rows of one split (unshuffled) and the length histogram of its samples."""
    from datasets import concatenate_datasets

    all_samples: list[Dataset] = []
    all_lengths: list[np.ndarray] = []
    raw_lengths: list[np.ndarray] = []
    # dataset_exact_deduplication: the digests of the split's records read so far.
    seen: set[bytes] | None = set() if config.data.dataset_exact_deduplication else None
    for n, (entry, source) in enumerate(zip(entries, sources, strict=True)):
        stats = DatasetStats(entry.path or "passkey", entry.type, split)
        if vp is not None:
            samples, lengths, raw = _vision_entry_samples(entry, source, config, vp,
                                                          work / f"{split}-{n}", stats, progress)
        else:
            samples, lengths, raw = _entry_samples(entry, source, config, tok,
                                                   work / f"{split}-{n}", stats, progress, seen)
        report.datasets.append(stats)
        all_samples.append(samples)
        all_lengths.append(lengths)
        raw_lengths.append(raw)
    lengths = np.concatenate(all_lengths)
    if len(lengths) == 0:
        raise UserError(
            f"no {split} samples are left to train on: "
            + "; ".join(_loss_summary(s) for s in report.datasets if s.split == split) + ".",
            where="datasets" if split == "train" else "eval_datasets",
            fix="check the data, raise `sequence_len`, or use "
            "`excess_length_strategy: truncate`.",
        )
    samples = all_samples[0] if len(all_samples) == 1 else concatenate_datasets(all_samples)
    if config.data.shuffle_merged_datasets and split == "train":
        # Mix the datasets before packing (FFD keeps input order among equal lengths).
        order = np.random.default_rng(config.training.seed).permutation(len(lengths))
        samples, lengths = samples.select(order), lengths[order]
    rows = _write_rows(samples, lengths, _row_format(vp), config, work / f"{split}-rows.arrow",
                       progress)
    return rows, length_histogram(np.concatenate(raw_lengths), config.data.sequence_len)


def _loss_summary(s: DatasetStats) -> str:
    return (f"{s.label}: {s.records} records, {s.skipped} skipped ({s.skip_reason}), "
            f"{s.dropped} longer than sequence_len dropped")


def _entry_samples(
    entry: DatasetConfig, source: load.Source | None, config: Config,
    tok: PreTrainedTokenizerBase, work: Path, stats: DatasetStats, progress: bool,
    seen: set[bytes] | None = None,
) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """(samples, their lengths, lengths before the excess-length rule) of one entry; with
    `seen` (dataset_exact_deduplication), its records not seen before only."""
    work.mkdir(parents=True)
    if entry.type == "passkey":
        samples = _passkey_samples(entry, config, tok, work)
        stats.records = len(samples)
    else:
        assert source is not None
        samples = _tokenized(entry, source, config, tok, work, stats, progress, seen)
    lengths = _lengths(samples)
    raw = lengths[lengths > 0]
    samples, lengths = _apply_length_rules(samples, lengths, _TEXT_ROWS, entry, source, config,
                                           stats)
    stats.samples, stats.tokens = len(lengths), int(lengths.sum())
    stats.target_tokens = _target_tokens(samples)
    if len(samples):
        first = samples[0]
        stats.sample = sample_segments(tok, first["input_ids"], first["labels"])
    return samples, lengths, raw


def _target_tokens(samples: Dataset) -> int:
    import pyarrow.compute as pc

    labels = pc.list_flatten(samples.data.column("labels"))
    return int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)


def sample_segments(
    tok: PreTrainedTokenizerBase, ids: list[int], labels: list[int], limit: int = 2000
) -> list[tuple[str, bool]]:
    """A sample as (text, is_target) runs for the report, cut after `limit` tokens."""
    runs: list[tuple[str, bool]] = []
    start = 0
    ids, labels = ids[:limit], labels[:limit]
    for t in range(1, len(ids) + 1):
        if t == len(ids) or (labels[t] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            runs.append((tok.decode(ids[start:t]), labels[start] != IGNORE_INDEX))
            start = t
    return runs


def _lengths(samples: Dataset) -> np.ndarray:
    import pyarrow.compute as pc

    column = samples.data.column("input_ids")
    return np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False),
                      dtype=np.int64)


def _passkey_samples(
    entry: DatasetConfig, config: Config, tok: PreTrainedTokenizerBase, work: Path
) -> Dataset:
    lengths = entry.context_lengths or [config.data.sequence_len]
    seed = entry.seed if entry.seed is not None else config.training.seed
    try:
        generated = passkey.generate_passkey_samples(
            tok, entry.num_samples, lengths, entry.depths, entry.key_length, seed)
    except ValueError as exc:
        raise UserError(f"{exc}.", where="datasets (type: passkey)",
                        fix="use longer `context_lengths`.") from None
    rows = ((s.input_ids, passkey.training_labels(s), list(range(len(s)))) for s in generated)
    return _write_samples(rows, work / "samples.arrow")


def _write_samples(rows: Any, path: Path) -> Dataset:
    """Write (input_ids, labels, position_ids) tuples to an Arrow file, memory-mapped back."""
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    batch: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    with ArrowWriter(features=_row_features(), path=str(path)) as writer:
        for ids, labels, pos in rows:
            batch["input_ids"].append(ids)
            batch["labels"].append(labels)
            batch["position_ids"].append(pos)
            if len(batch["input_ids"]) >= 256:
                writer.write_batch(batch)
                batch = {k: [] for k in batch}
        if batch["input_ids"]:
            writer.write_batch(batch)
        writer.finalize()
    return Dataset.from_file(str(path))


def _tokenized(
    entry: DatasetConfig, source: load.Source, config: Config, tok: PreTrainedTokenizerBase,
    work: Path, stats: DatasetStats, progress: bool, seen: set[bytes] | None = None,
) -> Dataset:
    load.prescan(source)
    records = load.load_records(source, entry, cache_dir=str(work / "hf"))
    stats.records = len(records)
    if len(records) == 0:
        raise load.empty_error(source)
    spec = format_spec(entry, config, tok)
    check_columns(entry, spec, records.column_names, source.label)
    where = RecordWhere(source, None)
    if entry.shards is not None:
        # A seeded shuffle, then one contiguous shard, kept in file order.
        order = np.random.default_rng(config.training.seed).permutation(len(records))
        keep = np.sort(np.array_split(order, entry.shards)[entry.shards_idx])
        records = records.select(keep)
        where = RecordWhere(source, keep.tolist())
        stats.records = len(records)
    if seen is not None:
        records, where = _new_records(records, where, seen, stats)
    _say(progress, f"Tokenizing {source.label}: {len(records):,} records")
    tokenized = records.map(
        formats.tokenize_batch, batched=True, with_indices=True,
        remove_columns=records.column_names,
        fn_kwargs={"tok": tok, "spec": spec, "where": where,
                   "max_chars": formats.max_record_chars(config.data.sequence_len)},
        features=_map_features(spec),
        num_proc=_num_proc(config, len(records)), desc=f"Tokenizing {_short(source.label)}",
        new_fingerprint=f"tokenize-{uuid.uuid4().hex}",
    )
    _count_skips(tokenized, stats)
    tokenized = tokenized.remove_columns("skip")
    if entry.type != "pretrain":
        return tokenized
    docs = (ids for batch in tokenized.iter(batch_size=256) for ids in batch["input_ids"])
    pieces = ((ids, list(ids), pos) for ids, pos in formats.pretrain_pieces(docs,
                                                                           config.data.sequence_len))
    return _write_samples(pieces, work / "pieces.arrow")


def _new_records(records: Dataset, where: RecordWhere, seen: set[bytes],
                 stats: DatasetStats) -> tuple[Dataset, RecordWhere]:
    """The records whose every field differs from each record in `seen` (which they join),
    in file order; `stats.duplicates` counts the others. Errors keep naming file lines."""
    keep = []
    for i, record in enumerate(records):
        digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str)
                                .encode()).digest()
        if digest not in seen:
            seen.add(digest)
            keep.append(i)
    stats.duplicates = len(records) - len(keep)
    if not stats.duplicates:
        return records, where
    lines = keep if where.origin is None else [where.origin[i] for i in keep]
    return records.select(keep), RecordWhere(where.source, lines)


def _map_features(spec: formats.FormatSpec) -> Any:
    """The tokenize map's columns, typed as in the rows (so entries concatenate)."""
    from datasets import Features, Value

    features = dict(_row_features())
    if spec.type == "pretrain":
        features = {"input_ids": features["input_ids"]}
    return Features({**features, "skip": Value("string")})


def format_spec(
    entry: DatasetConfig, config: Config, tok: PreTrainedTokenizerBase
) -> formats.FormatSpec:
    """The entry's options in the form the tokenize workers take."""
    spec = formats.FormatSpec(entry.type, field=entry.field,
                              train_on_inputs=config.data.train_on_inputs,
                              messages_field=entry.messages_field,
                              train_on_eos=entry.train_on_eos,
                              chosen_field=entry.field_chosen,
                              rejected_field=entry.field_rejected,
                              orpo=config.objective.rl == "orpo",
                              share_prompt=config.objective.prefix_sharing,
                              drop_system=entry.drop_system_message)
    if entry.type in ("chat_template.default", "chat_template.argilla",
                      "bradley_terry.chat_template"):  # pairs, rendered
        spec.template = chat_templates.resolve_template(config, entry, tok)[0]
    if entry.type != "chat_template":
        return spec
    mappings = dict(entry.message_property_mappings or {"role": "role", "content": "content"})
    mappings.setdefault("role", "role")
    mappings.setdefault("content", "content")
    if entry.message_field_role:
        mappings["role"] = entry.message_field_role
    if entry.message_field_content:
        mappings["content"] = entry.message_field_content
    if entry.field_thinking:
        mappings[entry.template_thinking_key] = entry.field_thinking
        spec.thinking_key = entry.template_thinking_key
    spec.mappings = mappings
    if entry.message_field_training:
        spec.training_keys = (entry.message_field_training,)
    if entry.roles is not None:
        spec.roles = {src: role for role, sources in entry.roles.items() for src in sources}
    spec.roles_to_train = tuple(spec.roles.get(r, r) for r in entry.roles_to_train)
    if config.model.tokenizer_use_mistral_common:
        return spec  # mistral-common encodes the chat itself; it has no template to render
    template, markers = chat_templates.resolve_template(config, entry, tok)
    spec.template, spec.end_markers = template, tuple(markers)
    return spec


def check_columns(entry: DatasetConfig, spec: formats.FormatSpec, columns: list[str],
                  label: str) -> None:
    """The records have the fields the entry's format reads."""
    missing = [c for c in spec.columns if c not in columns]
    if missing:
        key = {"chat_template": "field_messages", "completion": "field",
               "pretrain": "field"}.get(entry.type)
        raise UserError(
            f"has no field {missing[0]!r} (fields: {', '.join(columns)}).",
            where=label,
            fix=(f"set `{key}:` in this dataset entry to the column that holds the "
                 + ("conversation." if key == "field_messages" else "text.")) if key else
            f"a `{entry.type}` dataset needs the columns {', '.join(spec.columns)}.",
        )


def too_long_error(length: int, limit: int, count: str, where: str) -> UserError:
    """A sample over sequence_len under `excess_length_strategy: error`; `count` says how
    many of the dataset's are."""
    return UserError(
        f"a sample is {length:,} tokens long, more than sequence_len ({limit:,}); {count}.",
        where=where,
        fix="raise `sequence_len`, or set `excess_length_strategy: drop` or `truncate`.",
    )


@dataclass
class RecordWhere:
    """`file:line` of the i-th record the tokenizer sees (through a shard's selection)."""

    source: load.Source
    origin: list[int] | None

    def __call__(self, i: int) -> str:
        return self.source.where(self.origin[i] if self.origin is not None else i)


def _count_skips(tokenized: Dataset, stats: DatasetStats) -> None:
    from collections import Counter

    _record_skips(stats, Counter(r for r in tokenized["skip"] if r))


def _short(label: str) -> str:
    return label if len(label) <= 30 else "..." + label[-27:]


def _num_proc(config: Config, n_records: int) -> int | None:
    """Worker processes for tokenization: `num_proc` (default all cores), but no more than
    one per 1,000 records (a process pool costs more than it saves on small data)."""
    wanted = config.data.num_proc or os.cpu_count() or 1
    n = max(1, min(wanted, n_records // 1000))
    return n if n > 1 else None


@dataclass(frozen=True)
class _RowFormat:
    """What the one pipeline (length rules, truncation, packing) knows of its samples: a
    text run's (input_ids, labels, position_ids) or a vision run's documents, whose images
    a row must hold whole (`vp`: the processor)."""

    vp: VisionProcessor | None = None

    @property
    def unit(self) -> str:
        return "documents" if self.vp is not None else "samples"

    @property
    def cut_columns(self) -> tuple[str, ...] | None:
        """The columns truncation cuts: a document's text and its token types, never its
        pixels; every column of a text sample (None)."""
        return ("input_ids", "labels", "mm_token_type_ids") if self.vp is not None else None

    def features(self) -> Any:
        return vision.features(vision.DOC_COLUMNS) if self.vp is not None else None

    def refuse_too_long(self, samples: Dataset, lengths: np.ndarray, n: int,
                        source: load.Source | None, limit: int, count: int) -> None:
        """`excess_length_strategy: error` on sample `n` (`count` samples are too long)."""
        if self.vp is not None:  # says which and why (its image tokens)
            vision.check_fits(vision.docs_from_table(samples.data.slice(n, 1).table)[0], limit)
        where = source.where(n) if source else f"passkey sample {n + 1}"
        raise too_long_error(int(lengths[n]), limit, f"{count} samples of this dataset are",
                             where)

    def check_cuttable(self, samples: Dataset, lengths: np.ndarray, too_long: np.ndarray,
                       limit: int) -> None:
        """`truncate` cuts a document's text only where all of its image and video tokens
        stay (an image is never cut: its features would not match its tokens)."""
        if self.vp is None:
            return
        types, sources = samples.data.column("mm_token_type_ids"), samples.data.column("source")
        for n in np.flatnonzero(too_long).tolist():
            if any(t != vision.TEXT for t in types[n].as_py()[limit:]):
                raise UserError(
                    f"this conversation is {int(lengths[n]):,} tokens, more than sequence_len "
                    f"{limit:,}, and its image/video tokens reach past token {limit:,}; "
                    "`excess_length_strategy: truncate` cuts text only, never an image (its "
                    "features would no longer match its tokens).", where=sources[n].as_py(),
                    fix="use `excess_length_strategy: drop`, shrink the images (`image_size`, "
                    "or a smaller `max_pixels` in preprocessor_config.json), or raise "
                    "`sequence_len`.")

    def write(self, samples: Dataset, bins: list[list[int]], path: Path, progress: bool
              ) -> Dataset:
        """The bins' rows to an Arrow file, memory-mapped back: a vision row is
        `vision.vision_row` of its documents (vision.ROW_COLUMNS), so with FFD the rows are
        exactly `vision.pack_vision_documents`'."""
        if self.vp is None:
            chunks = pack.iter_chunks(bins, _CHUNK_BINS)
            if progress and len(bins) > 20 * _CHUNK_BINS and _on_terminal():
                from tqdm.auto import tqdm

                chunks = tqdm(chunks, total=-(-len(bins) // _CHUNK_BINS), desc="Packing",
                              unit="chunk")
            return _write_samples(_rows_of(samples, chunks), path)
        from datasets import Dataset
        from datasets.arrow_writer import ArrowWriter

        arrow = samples.with_format("arrow")
        with ArrowWriter(features=vision.features(vision.ROW_COLUMNS), path=str(path)) as writer:
            for chunk in pack.iter_chunks(bins, _VISION_CHUNK_BINS):
                wanted = sorted({i for b in chunk for i in b})
                docs = vision.docs_from_table(arrow[wanted])
                at = {i: k for k, i in enumerate(wanted)}
                writer.write_table(vision.rows_table(
                    [vision.vision_row([docs[at[i]] for i in b]) for b in chunk]))
            writer.finalize()
        return Dataset.from_file(str(path))


_TEXT_ROWS = _RowFormat()


def _row_format(vp: VisionProcessor | None) -> _RowFormat:
    return _RowFormat(vp) if vp is not None else _TEXT_ROWS


def _apply_length_rules(
    samples: Dataset, lengths: np.ndarray, fmt: _RowFormat, entry: DatasetConfig,
    source: load.Source | None, config: Config, stats: DatasetStats,
) -> tuple[Dataset, np.ndarray]:
    """Skip empty text samples and apply `excess_length_strategy` to those over
    sequence_len (a vision document is never empty: records without targets are skipped
    as they are encoded)."""
    limit = config.data.sequence_len
    keep = np.ones(len(lengths), dtype=bool)
    if fmt.vp is None:
        empty = lengths == 0
        if entry.type != "pretrain":
            stats.skipped = int(empty.sum())
        keep = ~empty
    too_long = lengths > limit
    stats.too_long = int(too_long.sum())
    if stats.too_long and config.data.excess_length_strategy == "error":
        fmt.refuse_too_long(samples, lengths, int(np.argmax(too_long)), source, limit,
                            stats.too_long)
    if stats.too_long and config.data.excess_length_strategy == "drop":
        keep &= ~too_long
        stats.dropped = stats.too_long
    elif stats.too_long:
        fmt.check_cuttable(samples, lengths, too_long, limit)
        samples = samples.map(_truncate, batched=True,
                              fn_kwargs={"limit": limit, "columns": fmt.cut_columns},
                              features=fmt.features(), desc="Truncating",
                              new_fingerprint=f"trunc-{uuid.uuid4().hex}")
        lengths = np.minimum(lengths, limit)
        stats.truncated = stats.too_long
    if not keep.all():
        index = np.flatnonzero(keep)
        samples, lengths = samples.select(index), lengths[index]
    return samples, lengths


def _truncate(batch: dict[str, list], *, limit: int, columns: tuple[str, ...] | None
              ) -> dict[str, list]:
    """The first `limit` tokens of each sample, in `columns` (None: every column)."""
    return {k: [v[:limit] for v in values] if columns is None or k in columns else values
            for k, values in batch.items()}


def _write_rows(
    samples: Dataset, lengths: np.ndarray, fmt: _RowFormat, config: Config, path: Path,
    progress: bool,
) -> Dataset:
    """Pack (or not) the samples into rows and write them to an Arrow file."""
    if config.data.sample_packing:
        packer = pack.sequential_bins if config.data.sample_packing_sequentially else pack.ffd_bins
        bins = packer(lengths.tolist(), config.data.sequence_len)
    else:
        bins = [[i] for i in range(len(lengths))]
    _say(progress, f"Packing {len(lengths):,} {fmt.unit} into {len(bins):,} rows")
    return fmt.write(samples, bins, path, progress)


def _rows_of(samples: Dataset, chunks: Any) -> Iterator[tuple[list[int], list[int], list[int]]]:
    for chunk in chunks:
        wanted = sorted({i for b in chunk for i in b})
        got = samples[wanted]  # one read per chunk: random single-row reads are slow
        at = {i: k for k, i in enumerate(wanted)}
        for b in chunk:
            row = pack.make_row((got["input_ids"][at[i]], got["labels"][at[i]],
                                 got["position_ids"][at[i]]) for i in b)
            yield row["input_ids"], row["labels"], row["position_ids"]


# ---- vision-language runs (processor_type) -----------------------------------------------


def _check_vision_run(config: Config) -> None:
    """What a vision run's data path does not build yet, refused before any work."""
    if config.objective.rl:
        raise UserError(
            f"`rl: {config.objective.rl}` with `processor_type` is not supported: longctx prepares "
            "vision-language data for supervised fine-tuning only.", where="rl",
            fix="remove `rl:` (supervised fine-tuning), or `processor_type` for a text model.")
    for key, entries in (("datasets", config.data.datasets),
                         ("eval_datasets", config.data.eval_datasets)):
        for n, entry in enumerate(entries):
            if entry.type in ("pretrain", "passkey") or formats.is_preference_type(entry.type):
                raise UserError(
                    f"a `{entry.type}` dataset cannot be part of a vision-language run "
                    "(`processor_type` is set).", where=f"{key}[{n}]",
                    fix="use `type: chat_template` for image-bearing conversations (or "
                    "another instruction type such as alpaca for text-only samples).")


def _vision_entry_samples(
    entry: DatasetConfig, source: load.Source | None, config: Config, vp: VisionProcessor,
    work: Path, stats: DatasetStats, progress: bool,
) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """(documents, their lengths, lengths before the excess-length rule) of one entry in a
    vision run: chat records through the processor, other types tokenized as text."""
    assert source is not None
    work.mkdir(parents=True)
    if entry.type == "chat_template":
        docs = _encoded_documents(entry, source, config, vp, work, stats, progress)
    else:
        docs = _text_documents(entry, source, config, vp, work, stats, progress)
    samples = _write_documents(docs, work / "documents.arrow")
    lengths = _lengths(samples)
    raw = lengths.copy()
    samples, lengths = _apply_length_rules(samples, lengths, _row_format(vp), entry, source,
                                           config, stats)
    stats.samples, stats.tokens = len(lengths), int(lengths.sum())
    if len(samples):
        import pyarrow.compute as pc

        table = samples.with_format("arrow")[:]  # through a drop's selection
        labels = pc.list_flatten(table.column("labels"))
        stats.target_tokens = int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
        stats.images = int(pc.sum(pc.list_value_length(table.column("image_grid_thw"))
                                  ).as_py() or 0)
        stats.image_tokens = int(pc.sum(pc.not_equal(
            pc.list_flatten(table.column("mm_token_type_ids")), vision.TEXT)).as_py() or 0)
        first = samples[0]
        stats.sample = _collapsed(sample_segments(vp.tokenizer, first["input_ids"],
                                                  first["labels"]), vp)
    return samples, lengths, raw


def _encoded_documents(
    entry: DatasetConfig, source: load.Source, config: Config, vp: VisionProcessor,
    work: Path, stats: DatasetStats, progress: bool,
) -> Iterator[vision.VisionDocument]:
    """The entry's records as documents, in record order; records with nothing to train on
    are counted as skipped ("no target tokens", as the text path counts them)."""
    from collections import Counter

    total, records = vision.entry_records(source, entry, str(work / "hf"), config.training.seed)
    stats.records = total
    if total == 0:
        raise load.empty_error(source)
    spec = format_spec(entry, config, vp.tokenizer)
    _say(progress, f"Encoding {source.label}: {total:,} records with the processor")
    if progress and _on_terminal():
        from tqdm.auto import tqdm

        records = tqdm(records, total=total, desc=f"Encoding {_short(source.label)}",
                       unit="record")
    skips: Counter[str] = Counter()
    for i, record, base in records:
        if not isinstance(record, dict):
            raise UserError(f"a record must be an object, found {type(record).__name__}.",
                            where=source.where(i), fix="write one JSON object per record.")
        doc = vision.encode_vision_record(dict(record), vp, source.where(i), base_dir=base,
                                          spec=spec)
        if not doc.has_targets:
            skips["no target tokens"] += 1
            continue
        yield doc
    _record_skips(stats, skips)


def _text_documents(
    entry: DatasetConfig, source: load.Source, config: Config, vp: VisionProcessor,
    work: Path, stats: DatasetStats, progress: bool,
) -> Iterator[vision.VisionDocument]:
    """A text dataset (alpaca, completion, ...) of a vision run, tokenized as in a text run
    with the processor's tokenizer: documents without images."""
    samples = _tokenized(entry, source, config, vp.tokenizer, work, stats, progress)
    width = vision.patch_dim(vp)
    empty = 0
    for i, sample in enumerate(samples):
        if not sample["input_ids"]:
            empty += 1
            continue
        where = source.where(i) if entry.shards is None else f"{source.label}, sample {i + 1}"
        yield vision.text_document(sample["input_ids"], sample["labels"], width, where)
    stats.skipped = empty


def _record_skips(stats: DatasetStats, counts: Any) -> None:
    stats.skip_reasons = dict(sorted(counts.items()))
    stats.skipped = sum(counts.values())
    if len(counts) == 1:
        stats.skip_reason = next(iter(counts))
    elif counts:
        stats.skip_reason = ", ".join(f"{why}: {n}" for why, n in sorted(counts.items()))


def _write_documents(docs: Any, path: Path) -> Dataset:
    """Documents to an Arrow file (vision.DOC_COLUMNS) in batches, memory-mapped back: the
    pixels of a whole dataset never sit in memory together."""
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    with ArrowWriter(features=vision.features(vision.DOC_COLUMNS), path=str(path)) as writer:
        batch: list[vision.VisionDocument] = []
        for doc in docs:
            batch.append(doc)
            if len(batch) >= _VISION_BATCH:
                writer.write_table(vision.docs_table(batch))
                batch = []
        if batch:
            writer.write_table(vision.docs_table(batch))
        writer.finalize()
    return Dataset.from_file(str(path))


def _collapsed(runs: list[tuple[str, bool]], vp: VisionProcessor) -> list[tuple[str, bool]]:
    """A report sample with each run of image/video tokens written once with its count."""
    tokens = list(vp.feature_tokens.values())
    pattern = re.compile("|".join(f"(?:{re.escape(t)}){{2,}}" for t in tokens))

    def shorter(match: re.Match[str]) -> str:
        text = match.group(0)
        token = next(t for t in tokens if text.startswith(t))
        return f"{token}x{len(text) // len(token)}"

    return [(pattern.sub(shorter, text), target) for text, target in runs]

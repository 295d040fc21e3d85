"""The prepared-data cache: fingerprints of the inputs, and the life of a cache entry.

The cache of one set of inputs is `<config.prepared_path>/<fingerprint>/`: configs that share
a `dataset_prepared_path` each keep their own entry and never evict one another. An entry
holds `train/` (and `eval/`) saved with `datasets`, the fingerprint of every input that
determines them, the report, and a `COMPLETE` marker. It is built in a temporary folder next
to the target and renamed into place, so a failed or interrupted run never leaves a cache
that a later run would accept, nor damages a good one.

This module decides where an entry lives, whether it can be reused (and why not), and how it
is written; what goes into `train/` and `eval/` is `prepare`'s business. It also keys an
entry by its inputs (`confirm_warm`, `remember_inputs`), so that the launcher confirms a warm
cache without loading the tokenizer or `datasets` and hands it to the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.data import chat_templates, load
from longctx_cli.data.report import PrepareReport
from longctx_cli.data.tokenizer import tokenizer_fingerprint
from longctx_cli.durable import COMPLETE_MARKER, fsync_tree, swap_into_place
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config, DatasetConfig
    from longctx_cli.data.rows import Rows
    from longctx_cli.data.vision.processor import VisionProcessor

__all__ = [
    "EVAL_DIR", "FINGERPRINT_FILE", "PIPELINE_VERSION", "REPORT_FILE", "SCRATCH_DIR", "TRAIN_DIR",
    "DATA_CACHE_ENV", "INPUTS_DIR", "Prepared", "WarmEntry", "compute_fingerprint",
    "confirm_warm", "digest", "entry_handed_to_this_rank", "entry_path", "find_entry",
    "fingerprint_parts", "handed_over", "inputs_key", "inputs_parts", "read_entry",
    "remember_inputs", "witness", "write_entry",
]

# Bump when the meaning of a cached row changes, so old caches are rebuilt, not misread.
# 2: the passkey key is bracketed.
# 3: chat targets located by offsets (with train_on_eos), alpaca/input_output, samples
#    shuffled before packing (shuffle_merged_datasets).
PIPELINE_VERSION = 3

# The layout of an entry.
FINGERPRINT_FILE = "fingerprint.json"
REPORT_FILE = "report.json"
TRAIN_DIR = "train"
EVAL_DIR = "eval"
SCRATCH_DIR = "work"  # the builder's intermediate files; removed before the entry is sealed

_FINGERPRINT_NAME = re.compile(r"^[0-9a-f]{16}$")
_TEMPORARY_NAME = re.compile(r"^\.[0-9a-f]{16}\.(tmp|old)-")


@dataclass
class Prepared:
    """The result of `prepare`: rows ready for the trainer, and what was done."""

    train: Dataset | Rows
    eval: Dataset | Rows | None
    report: PrepareReport
    reused: bool
    path: str


# ---- fingerprint -------------------------------------------------------------------------


def compute_fingerprint(config: Config, tokenizer: PreTrainedTokenizerBase | None,
                        processor: VisionProcessor | None = None) -> str:
    """The fingerprint `prepare` would give the cache of `config` (reads the data files;
    a vision run's processor is loaded from the config when not given, and its tokenizer
    is the one used)."""
    if config.vision.processor_type:
        from longctx_cli.data.tokenizer import load_config_processor

        processor = processor or load_config_processor(config)
        tokenizer = processor.tokenizer
    assert tokenizer is not None
    train = [load.source_of(e) for e in config.data.datasets]
    evals = [load.source_of(e) for e in config.data.eval_datasets]
    return digest(fingerprint_parts(config, tokenizer, train, evals, processor))


def fingerprint_parts(
    config: Config,
    tok: PreTrainedTokenizerBase,
    train_sources: list[load.Source | None],
    eval_sources: list[load.Source | None],
    processor: VisionProcessor | None = None,
) -> dict[str, Any]:
    """Everything that determines the prepared rows, as a JSON-able dict.

    A vision run (`processor_type`) adds the processor's settings and, per chat dataset, the
    bytes of every image file its records name (`tok` is then the processor's tokenizer)."""
    parts = {**_run_parts(config, train_sources, eval_sources, load.content_hash,
                          _file_content),
             "tokenizer": tokenizer_fingerprint(tok)}
    if config.vision.processor_type:
        from longctx_cli.data.vision.processor import processor_fingerprint

        if processor is None:
            raise ValueError("a vision run's fingerprint needs its processor")
        parts["processor"] = processor_fingerprint(processor)
    return parts


def _run_parts(
    config: Config,
    train_sources: list[load.Source | None],
    eval_sources: list[load.Source | None],
    identify: Callable[[load.Source, DatasetConfig], str],
    identify_file: Callable[[Path], Any],
) -> dict[str, Any]:
    """The parts of the fingerprint besides the tokenizer; `identify` names a data source's
    content (its bytes' hash for the fingerprint, its files' sizes and times for a witness),
    `identify_file` one image file's the same way."""
    def entry_part(e: DatasetConfig, s: load.Source | None) -> dict[str, Any]:
        part = _entry_part(e, s, identify)
        if config.vision.processor_type and s is not None and e.type == "chat_template":
            part["images"] = _images_part(s, e, config.training.seed, identify_file)
        return part

    return {
        "pipeline": PIPELINE_VERSION,
        "sequence_len": config.data.sequence_len,
        "sample_packing": config.data.sample_packing,
        "sample_packing_sequentially": config.data.sample_packing_sequentially,
        "curriculum_sampling": config.data.curriculum_sampling,
        "excess_length_strategy": config.data.excess_length_strategy,
        "seed": config.training.seed,
        "val_set_size": config.data.val_set_size,
        "train_on_inputs": config.data.train_on_inputs,
        "shuffle_merged_datasets": config.data.shuffle_merged_datasets,
        # Only when on, so other caches keep their names.
        **({"exact_deduplication": True} if config.data.dataset_exact_deduplication else {}),
        "chat_template": config.data.chat_template,
        "chat_template_jinja": _jinja_part(config),
        "named_templates": hashlib.sha256(json.dumps(chat_templates.TEMPLATES, sort_keys=True)
                                          .encode()).hexdigest()[:16],
        "datasets": [entry_part(e, s)
                     for e, s in zip(config.data.datasets, train_sources, strict=True)],
        "eval_datasets": [entry_part(e, s)
                          for e, s in zip(config.data.eval_datasets, eval_sources, strict=True)],
        # ORPO tokenizes pairs its own way (only then, so other caches keep their names).
        **({"pair_tokenization": "orpo"} if config.objective.rl == "orpo" else {}),
        **({"prefix_sharing": True} if config.objective.prefix_sharing else {}),
        # rl: grpo keeps prompts, not packed rows (data/prompts.py).
        **({"grpo_prompts": _prompts_part(config)} if config.objective.rl == "grpo" else {}),
        # rl: kto writes labelled examples in TRL's batches of micro_batch_size (data/kto.py).
        **({"kto_batch": config.training.micro_batch_size} if config.objective.rl == "kto"
           else {}),
        # A vision run (only then, so text caches keep their names).
        **({"vision": _vision_part(config)} if config.vision.processor_type else {}),
    }


def _vision_part(config: Config) -> dict[str, Any]:
    from longctx_cli.data.vision.processor import VISION_VERSION

    size = config.vision.image_size
    return {"version": VISION_VERSION, "image_size": list(size) if isinstance(size, tuple)
            else size, "image_resize_algorithm": config.vision.image_resize_algorithm}


def _images_part(source: load.Source, entry: DatasetConfig, seed: int,
                 identify_file: Callable[[Path], Any]) -> str:
    """Digest of every local file the entry's records name, in the order they appear (the
    records themselves, names included, are in the data's content hash). Hashing the files
    costs a read of each image per `prepare`; decoding them is what a build costs."""
    import tempfile

    from longctx_cli.data.vision.records import entry_records, referenced_files

    h = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="longctx-scan-") as scratch:
        _, records = entry_records(source, entry, scratch, seed)
        for _, record, base in records:
            for path in referenced_files(record, base):
                h.update(json.dumps(identify_file(path)).encode() + b"\x00")
    return h.hexdigest()[:16]


def _prompts_part(config: Config) -> dict[str, Any]:
    from longctx_cli.data.prompts import fingerprint

    return fingerprint(config)


def digest(parts: dict[str, Any]) -> str:
    """The fingerprint of `fingerprint_parts`: 16 hex digits, also the entry's folder name."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _entry_part(entry: DatasetConfig, source: load.Source | None,
                identify: Callable[[load.Source, DatasetConfig], str]) -> dict[str, Any]:
    part = entry.model_dump(mode="json")
    if source is not None:
        part["content"] = identify(source, entry)
    return part


def _jinja_part(config: Config) -> str | None:
    """The custom template's text (hashed), so editing a .jinja file rebuilds the cache."""
    if config.data.chat_template_jinja is None:
        return None
    try:
        text = chat_templates._jinja_text(config.data.chat_template_jinja)
    except UserError:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Names of the inputs that differ, e.g. `sequence_len`, `datasets[0].content`."""
    diffs: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if isinstance(x, dict) and isinstance(y, dict):
                    diffs += [f"{key}[{i}].{k}" for k in sorted(set(x) | set(y))
                              if x.get(k) != y.get(k)]
        else:
            diffs.append(key)
    return diffs


# ---- reading an entry --------------------------------------------------------------------


def entry_path(prepared_path: str | Path, fingerprint: str) -> Path:
    """Where the entry of `fingerprint` lives under a `dataset_prepared_path`."""
    return Path(prepared_path) / fingerprint


def find_entry(target: Path, fp: str, parts: dict[str, Any]) -> tuple[Prepared | None, str]:
    """(Prepared, "") when `target` is a complete entry with fingerprint `fp`, else (None, why
    it cannot be reused), the why naming the inputs that changed where it can tell."""
    if not target.exists():
        return None, _compared_with_siblings(target, parts)
    return _load_entry(target, fp, parts)


def _load_entry(target: Path, fp: str, parts: dict[str, Any], light: bool = False
                ) -> tuple[Prepared | None, str]:
    """(Prepared, "") when `target` is a complete cache with fingerprint `fp`, else (None, why).

    `light`: read the splits as `rows.Rows` (no `datasets` import) where they allow it."""
    if not target.exists():
        return None, "no cache yet"
    marker = target / COMPLETE_MARKER
    if not marker.is_file():
        return None, "the existing cache is incomplete (no completion marker)"
    try:
        recorded = json.loads((target / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None, "the existing cache has no readable fingerprint"
    if marker.read_text().strip() != fp or recorded.get("fingerprint") != fp:
        changed = _differences(recorded.get("parts", {}), parts)
        return None, "inputs changed since the cache was built: " + (
            ", ".join(changed) or "fingerprint")
    try:
        train = _read_split(target / TRAIN_DIR, light)
        eval_ds = _read_split(target / EVAL_DIR, light) if (target / EVAL_DIR).is_dir() else None
        report = PrepareReport.from_dict(json.loads((target / REPORT_FILE).read_text()))
    except Exception as exc:  # noqa: BLE001 - any unreadable cache is simply rebuilt
        return None, f"the existing cache is unreadable ({type(exc).__name__})"
    report.reused = True
    report.reason = "fingerprint matches"
    report.path = str(target)
    return Prepared(train, eval_ds, report, True, str(target)), ""


def _read_split(folder: Path, light: bool) -> Any:
    """A saved split: `Rows` when `light` and it is a plain one, else a `datasets.Dataset`."""
    if light:
        from longctx_cli.data.rows import Rows

        rows = Rows.read(folder)
        if rows is not None:
            return rows
    import datasets

    return datasets.load_from_disk(str(folder))


def _compared_with_siblings(target: Path, parts: dict[str, Any]) -> str:
    """Why there is no cache for these inputs: none at all, or what differs from the newest
    cache of other inputs in the same `dataset_prepared_path`."""
    newest = None
    if target.parent.is_dir():
        found = [d for d in target.parent.iterdir()
                 if _FINGERPRINT_NAME.match(d.name) and (d / COMPLETE_MARKER).is_file()]
        newest = max(found, key=lambda d: (d / COMPLETE_MARKER).stat().st_mtime, default=None)
    if newest is None:
        return "no cache yet"
    try:
        recorded = json.loads((newest / FINGERPRINT_FILE).read_text()).get("parts", {})
    except (OSError, ValueError):
        return "no cache yet for these inputs"
    changed = _differences(recorded, parts)
    return (f"no cache yet for these inputs (the newest cache there, {newest.name}, differs "
            f"in: {', '.join(changed) or 'fingerprint'})")


# ---- a warm entry confirmed from its inputs (no tokenizer, no `datasets`) -------------------
#
# The fingerprint needs the tokenizer loaded (its vocabulary, its output on a probe) and
# `prepare` reads the entry back with `datasets`: seconds before the first step, spent on
# the launcher and again on every rank. The *inputs key* names the same inputs by what the
# tokenizer is built from instead (its files' bytes, the library versions, longctx's
# tokenizer code, `special_tokens`). After a full check found or built an entry for a set of
# inputs, the key is recorded in it (`INPUTS_DIR`); the same key later confirms the entry
# without the tokenizer. The launcher then hands the entry to its ranks (`DATA_CACHE_ENV`)
# with a *witness* of the inputs (the data and tokenizer files' sizes and modification
# times, and the config's parts), which each rank recomputes: only a match is trusted.

INPUTS_DIR = "inputs"
DATA_CACHE_ENV = "LONGCTX_DATA_CACHE"
# Files of a tokenizer folder the tokenizer never reads (a model folder's weights): left out.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack",
                    ".onnx", ".ckpt")
# Larger files (never a real tokenizer's) are named by size and time, not hashed.
_HASHED_FILE_LIMIT = 64 << 20
# Libraries whose version can change what a tokenizer produces from the same files.
_TOKENIZER_LIBRARIES = ("transformers", "tokenizers", "sentencepiece", "tiktoken")


@dataclass(frozen=True)
class WarmEntry:
    """A complete cache entry confirmed for a run's inputs."""

    path: Path
    fingerprint: str
    key: str  # the inputs key it was confirmed by
    witness: str  # digest of the inputs' witness parts when it was confirmed


def _file_stat(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _file_content(path: Path) -> str | list[Any]:
    if path.stat().st_size > _HASHED_FILE_LIMIT:
        return _file_stat(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _stat_identity(source: load.Source, entry: DatasetConfig) -> str:
    """A data source named by its files' sizes and modification times (hub: coordinates)."""
    if source.kind == "hub":
        return load.content_hash(source, entry)
    return json.dumps([_file_stat(f) for f in source.files])


def _library_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _tokenizer_source(config: Config, identify: Callable[[Path], Any]) -> dict[str, Any] | None:
    """What `load_tokenizer(config)` builds its tokenizer from, each file named by
    `identify`; None where that cannot be pinned without loading it: a hub id (its files
    can change on the hub) or remote code."""
    from longctx_cli.data import tokenizer as tokenizer_module

    source = config.model.tokenizer_source
    code = [Path(tokenizer_module.__file__)]
    if config.vision.processor_type:  # a vision run's tokenizer is its processor's
        from longctx_cli.data.vision import processor

        source = processor.processor_folder(config)
        code.append(Path(processor.__file__))
    if source is None or config.model.trust_remote_code:
        return None
    if source == tokenizer_module.BYTE:
        files: Any = tokenizer_module.BYTE
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            return None
        files = {f.name: identify(f) for f in sorted(folder.iterdir())
                 if f.is_file() and f.suffix.lower() not in _WEIGHT_SUFFIXES}
    special = config.model.special_tokens
    if config.model.tokenizer_use_mistral_common:  # another library reads the same files
        from longctx_cli.data import mistral_tokenizer

        code.append(Path(mistral_tokenizer.__file__))
        files = {"mistral_common": _library_version("mistral-common"), "files": files}
    return {
        "files": files,
        "libraries": {name: _library_version(name) for name in _TOKENIZER_LIBRARIES
                      + (("pillow",) if config.vision.processor_type else ())},
        "code": identify(code[0]) if len(code) == 1 else [identify(c) for c in code],
        "special_tokens": special.model_dump(mode="json") if special is not None else None,
        "trust_remote_code": config.model.trust_remote_code,
        **({"tokens": config.model.tokens} if config.model.tokens else {}),  # added tokens
    }


def _sources(config: Config) -> tuple[list[load.Source | None], list[load.Source | None]]:
    return ([load.source_of(e) for e in config.data.datasets],
            [load.source_of(e) for e in config.data.eval_datasets])


def inputs_parts(config: Config) -> dict[str, Any] | None:
    """The inputs key's parts: the fingerprint's, with the tokenizer's source (hashed files)
    in place of the loaded tokenizer; None when the tokenizer must be loaded to know it."""
    tokenizer = _tokenizer_source(config, _file_content)
    if tokenizer is None:
        return None
    return {**_run_parts(config, *_sources(config), load.content_hash, _file_content),
            "tokenizer_source": tokenizer}


def witness(config: Config) -> str | None:
    """Digest of the inputs as the file system shows them (sizes and modification times, no
    reading): cheap enough for every rank to check a handed-over entry against."""
    tokenizer = _tokenizer_source(config, _file_stat)
    if tokenizer is None:
        return None
    return digest({**_run_parts(config, *_sources(config), _stat_identity, _file_stat),
                   "tokenizer_source": tokenizer})


def _is_sealed(target: Path, fp: str) -> bool:
    """`target` is a complete entry of fingerprint `fp` whose datasets' files are all there
    (what `datasets.load_from_disk` reads, checked without importing it)."""
    try:
        if (target / COMPLETE_MARKER).read_text().strip() != fp:
            return False
        if json.loads((target / FINGERPRINT_FILE).read_text()).get("fingerprint") != fp:
            return False
        json.loads((target / REPORT_FILE).read_text())
        for split in (TRAIN_DIR, EVAL_DIR):
            folder = target / split
            if split == EVAL_DIR and not folder.exists():
                continue
            state = json.loads((folder / "state.json").read_text())
            names = [f["filename"] for f in state["_data_files"]]
            if not names or not all((folder / n).is_file() for n in names):
                return False
            if not (folder / "dataset_info.json").is_file():
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def confirm_warm(config: Config) -> WarmEntry | None:
    """The complete entry recorded for `config`'s inputs key, or None (no key for these
    inputs, none recorded, or the entry is not sealed): then `prepare` decides."""
    before = witness(config)
    parts = inputs_parts(config)
    if before is None or parts is None:
        return None
    key = digest(parts)
    root = Path(config.prepared_path)
    for record in sorted(root.glob(f"*/{INPUTS_DIR}/{key}.json")) if root.is_dir() else []:
        target = record.parent.parent
        if _FINGERPRINT_NAME.match(target.name) and _is_sealed(target, target.name):
            if witness(config) != before:  # a file changed while it was hashed
                return None
            return WarmEntry(target, target.name, key, before)
    return None


def remember_inputs(config: Config, target: Path, fp: str, key_before: str | None,
                    witness_before: str | None) -> WarmEntry | None:
    """Record in the entry `target` (fingerprint `fp`, just confirmed or built by `prepare`)
    that the inputs key `key_before` leads to it, when the inputs are unchanged since that
    key was taken (so the full check saw the same inputs); the entry as a WarmEntry then."""
    if key_before is None or witness_before is None or not _is_sealed(target, fp):
        return None
    parts = inputs_parts(config)
    if parts is None or digest(parts) != key_before or witness(config) != witness_before:
        return None
    folder = target / INPUTS_DIR
    try:
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{key_before}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps({"fingerprint": fp, "parts": parts}, indent=1,
                                  sort_keys=True))
        os.replace(tmp, folder / f"{key_before}.json")  # whole or absent for a reader
    except OSError:
        return None  # a read-only cache: the next run checks it in full, as before
    return WarmEntry(target, fp, key_before, witness_before)


def inputs_key(config: Config) -> str | None:
    """The digest of `inputs_parts`, or None."""
    parts = inputs_parts(config)
    return digest(parts) if parts is not None else None


def handed_over(entry: WarmEntry) -> str:
    """The value of `DATA_CACHE_ENV` that hands `entry` to the ranks."""
    return json.dumps({"path": str(entry.path), "fingerprint": entry.fingerprint,
                       "key": entry.key, "witness": entry.witness})


def entry_handed_to_this_rank(config: Config) -> WarmEntry | None:
    """The entry the launcher confirmed for this run, if it handed one over and this rank's
    own witness of the inputs matches the launcher's (else None: check in full)."""
    raw = os.environ.get(DATA_CACHE_ENV)
    if not raw:
        return None
    try:
        state = json.loads(raw)
        entry = WarmEntry(Path(state["path"]), str(state["fingerprint"]), str(state["key"]),
                          str(state["witness"]))
    except (ValueError, KeyError, TypeError):
        return None
    if Path(entry.path).parent != Path(config.prepared_path):
        return None
    if not (entry.path / INPUTS_DIR / f"{entry.key}.json").is_file():
        return None
    if not _is_sealed(entry.path, entry.fingerprint) or witness(config) != entry.witness:
        return None
    return entry


def read_entry(target: Path, fp: str) -> Prepared | None:
    """The rows of the complete entry `target` with fingerprint `fp` (as `rows.Rows`, which
    a rank reads without importing `datasets`), or None when it is not one."""
    prepared, _ = _load_entry(target, fp, {}, light=True)
    return prepared


# ---- writing an entry --------------------------------------------------------------------


def write_entry(
    target: Path, fp: str, parts: dict[str, Any], reason: str,
    fill: Callable[[Path], PrepareReport],
) -> Prepared:
    """Build the entry `target` and put it in place atomically; the entry read back.

    `fill(tmp)` writes `TRAIN_DIR` (and `EVAL_DIR`) into the temporary folder `tmp`, keeps
    its intermediate files under `SCRATCH_DIR`, and returns the report. Concurrent writers
    each fill their own temporary folder, and only one of them ends up in place.
    """
    _check_replaceable(target.parent)
    created_root = not target.parent.exists()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        report = fill(tmp)
        report.fingerprint, report.reason = fp, reason
        report.path = str(target)
        shutil.rmtree(tmp / SCRATCH_DIR, ignore_errors=True)
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fp, "parts": parts},
                                                       indent=1, sort_keys=True))
        (tmp / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=1))
        fsync_tree(tmp)
        (tmp / COMPLETE_MARKER).write_text(fp)  # last: only a finished cache carries it
        swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created_root:
            with contextlib.suppress(OSError):
                target.parent.rmdir()  # only when empty: leave nothing of a failed first build
        raise
    prepared, why = _load_entry(target, fp, parts)
    if prepared is None:  # another process replaced it between our rename and this read
        raise UserError(f"the cache at {target} changed while it was being written ({why}).",
                        fix="run one `preprocess` at a time for a given dataset_prepared_path.")
    prepared.report.reused = False
    prepared.report.reason = reason
    prepared.reused = False
    return prepared


def _check_replaceable(root: Path) -> None:
    """Refuse to write into a `dataset_prepared_path` that holds anything but our caches
    (entries named by fingerprint, their temporaries, or a cache of the older one-entry
    layout) or is not a folder."""
    if not root.exists():
        return
    if root.is_dir() and all(_is_ours(child) for child in root.iterdir()):
        return
    raise UserError(
        f"dataset_prepared_path {str(root)!r} exists and is not a longctx data cache; "
        "it will not be overwritten.",
        where="dataset_prepared_path",
        fix="point `dataset_prepared_path` at a new folder, or remove that one.",
    )


def _is_ours(child: Path) -> bool:
    name = child.name
    return (bool(_FINGERPRINT_NAME.match(name)) or bool(_TEMPORARY_NAME.match(name))
            or name in (COMPLETE_MARKER, FINGERPRINT_FILE, REPORT_FILE, TRAIN_DIR, EVAL_DIR))


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temp folders of builds whose process is gone (crashed or killed runs)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        pid = stale.name.split("-")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    for old in target.parent.glob(f".{target.name}.old-*"):
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""Load one `datasets:` entry as a `datasets.Dataset` of raw records, with precise errors.

Local files are pre-scanned line by line before `datasets` sees them: its own JSON errors
name neither the file nor the line, ours do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from datasets import Dataset

    from longctx_cli.config.schema import DatasetConfig

# File suffix -> `datasets` packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text",
            ".csv": "csv", ".arrow": "arrow"}
_LOCAL_HINTS = ("/", "./", "../", "~")
# `path: json` (csv, parquet, text, arrow) with `data_files:` names a Hugging Face packaged
# loader, not a hub repository (`load_dataset("json", data_files=...)`): the files are local.
PACKAGED_BUILDERS = frozenset(BUILDERS.values())


@dataclass
class Source:
    """Where an entry's records come from."""

    kind: str  # "files" (local files of one builder), "disk" (save_to_disk folder) or "hub"
    label: str  # how errors and the report name it
    files: list[Path] = field(default_factory=list)
    builder: str | None = None
    # For .jsonl files: the 1-based line number of every record (blank lines are skipped),
    # so a bad record can be reported as file:line.
    line_numbers: dict[Path, list[int]] = field(default_factory=dict)

    def where(self, row: int) -> str:
        """`file:line` (or `label, row N`) of the row-th record, counting across files."""
        for f in self.files:
            lines = self.line_numbers.get(f)
            if lines is None:
                break
            if row < len(lines):
                return f"{f}:{lines[row]}"
            row -= len(lines)
        return f"{self.label}, record {row + 1}"


def resolve(entry: DatasetConfig) -> Source:
    """Decide where an entry points: local file(s), local folder, or hub dataset id.

    `data_files` name files inside a local `path` folder (or, without `path`, relative to
    the current directory), or files of a hub dataset. `ds_type` overrides the builder a
    file's suffix implies.
    """
    if entry.data_files is not None:
        return _resolve_data_files(entry)
    assert entry.path is not None
    raw = entry.path
    path = Path(raw).expanduser()
    if path.is_file():
        builder = entry.ds_type or _builder_for(path)
        return Source("files", str(path), [path], builder)
    if path.is_dir():
        return _resolve_folder(path, entry.ds_type)
    if raw.startswith(_LOCAL_HINTS) or path.suffix in BUILDERS or raw.count("/") > 1:
        raise UserError(
            f"dataset file {raw!r} does not exist.",
            where="datasets",
            fix="check the path (relative paths are relative to the current directory), "
            "or give a hub dataset id such as `org/name`.",
        )
    return Source("hub", raw)


def source_of(entry: DatasetConfig) -> Source | None:
    """The entry's Source, or None for generated (`passkey`) data, which reads no files."""
    if entry.type == "passkey":
        return None
    if not entry.path and not entry.data_files:
        raise UserError(
            f"a `{entry.type}` dataset needs a `path`.",
            where="datasets",
            fix="set `path:` to a local file or folder, or a hub dataset id.",
        )
    return resolve(entry)


def _resolve_data_files(entry: DatasetConfig) -> Source:
    names = [entry.data_files] if isinstance(entry.data_files, str) else list(entry.data_files)
    base = Path(entry.path).expanduser() if entry.path else Path(".")
    packaged = entry.path in PACKAGED_BUILDERS and not base.exists()
    if packaged:  # files relative to the current directory, read by that loader
        base = Path(".")
    elif entry.path and not base.is_dir():
        if base.exists():
            raise UserError(
                f"`data_files` needs `path` to be a folder or a hub id; {entry.path!r} is a "
                "file.", where="datasets", fix="drop `data_files`, or point `path` at a folder.")
        return Source("hub", entry.path, builder=entry.ds_type)
    files = [base / Path(n).expanduser() for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"data file {missing[0]!r} does not exist.", where="datasets",
                        fix="check `data_files` (relative to `path`, or to the current "
                        "directory without `path`).")
    builders = {entry.ds_type or (entry.path if packaged else _builder_for(f)) for f in files}
    if len(builders) > 1:
        raise UserError(f"`data_files` mix file types ({', '.join(sorted(builders))}).",
                        where="datasets", fix="list files of one type per dataset entry.")
    label = str(files[0]) if packaged or not entry.path else str(entry.path)
    return Source("files", label, files, builders.pop())


def _builder_for(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(
            f"unsupported file type {path.suffix or '(no suffix)'!r}.",
            where=str(path),
            fix=f"use one of {', '.join(BUILDERS)} (or a folder of them).",
        )
    return builder


def _resolve_folder(path: Path, ds_type: str | None = None) -> Source:
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return Source("disk", str(path), sorted(p for p in path.rglob("*") if p.is_file()))
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    files = [p for p in files if not any(part.startswith(".") for part in p.parts)]
    if not files:
        raise UserError(
            f"folder {str(path)!r} holds no data files.",
            where="datasets",
            fix=f"put {', '.join(BUILDERS)} files in it, or point `path` at a file.",
        )
    builders = {ds_type or BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UserError(
            f"folder {str(path)!r} mixes file types "
            f"({', '.join(sorted({p.suffix for p in files}))}).",
            where="datasets",
            fix="keep one type of file per folder, or list the files as separate datasets.",
        )
    return Source("files", str(path), files, builders.pop())


def content_hash(source: Source, entry: DatasetConfig) -> str:
    """Hash of the bytes of every local file (name-independent), or the hub coordinates."""
    h = hashlib.sha256()
    if source.kind == "hub":
        h.update(json.dumps([entry.path, entry.name, entry.split, entry.revision]).encode())
        return "hub:" + h.hexdigest()[:16]
    for f in source.files:
        h.update(b"\x00file\x00")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def prescan(source: Source) -> None:
    """Check local text files are UTF-8 and every .jsonl line is a JSON object."""
    if source.kind != "files":
        return
    for f in source.files:
        if source.builder in ("parquet", "arrow") or f.suffix.lower() in (".parquet", ".arrow"):
            continue
        if is_jsonl(source, f):
            source.line_numbers[f] = _scan_jsonl(f)
        elif f.suffix.lower() == ".json":
            _scan_json(f)
        else:
            _scan_text(f)


def _decode(raw: bytes, f: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}).",
            where=f"{f}:{lineno}",
            fix="re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).",
        ) from None


def _scan_jsonl(f: Path) -> list[int]:
    return [lineno for lineno, _ in jsonl_records(f)]


def jsonl_records(f: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of every record of a .jsonl file, in order; a line that is not
    UTF-8 or not one JSON object is a UserError at its `file:line`."""
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            text = _decode(raw, f, lineno).strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"invalid JSON ({exc.msg} at column {exc.colno}).",
                    where=f"{f}:{lineno}",
                    fix="every line of a .jsonl file must be one complete JSON object.",
                ) from None
            if not isinstance(record, dict):
                raise UserError(
                    f"expected a JSON object ({{...}}), found {type(record).__name__}.",
                    where=f"{f}:{lineno}",
                    fix='write one object per line, e.g. {"text": "..."}.',
                )
            yield lineno, record


def is_jsonl(source: Source, f: Path) -> bool:
    """Whether `f` is read as JSON Lines (one record a line)."""
    return f.suffix.lower() == ".jsonl" or (source.builder == "json"
                                            and f.suffix.lower() != ".json")


def json_array(f: Path) -> list[dict[str, Any]] | None:
    """The records of a .json file holding one array of objects (checked as `prescan` does);
    None: it holds JSON Lines instead."""
    try:
        _scan_json(f)
        data = json.loads(f.read_bytes())
    except json.JSONDecodeError:
        return None  # "Extra data": JSON Lines, which _scan_json checked line by line
    return data


def _scan_json(f: Path) -> None:
    raw = f.read_bytes()
    text = _decode_whole(raw, f)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            # JSON Lines saved as .json: `datasets` reads that too; check it line by line.
            _scan_jsonl(f)
            return
        raise UserError(
            f"invalid JSON ({exc.msg} at column {exc.colno}).",
            where=f"{f}:{exc.lineno}",
            fix="fix the JSON there (a .json file holds one array of objects).",
        ) from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UserError(
            "a .json dataset must be an array of objects: [{...}, {...}].",
            where=str(f),
            fix="use that layout, or JSON Lines (.jsonl) with one object per line.",
        )


def _decode_whole(raw: bytes, f: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(
            f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {col}).",
            where=f"{f}:{lineno}",
            fix="re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).",
        ) from None


def _scan_text(f: Path) -> None:
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            _decode(raw, f, lineno)


def load_records(source: Source, entry: DatasetConfig, cache_dir: str | None) -> Dataset:
    """The entry's records as a `datasets.Dataset` (one split).

    `cache_dir` keeps the Arrow copies of local files out of the shared Hugging Face cache;
    hub datasets use the normal cache so they are downloaded once.
    """
    import datasets

    if source.kind == "disk":
        return _from_disk(source)
    if source.kind == "hub":
        return _from_hub(source, entry)
    data_files = {entry.split: [str(f) for f in source.files]}
    try:
        ds = datasets.load_dataset(
            source.builder, data_files=data_files, split=entry.split, cache_dir=cache_dir
        )
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise UserError(
            f"could not be read: {first}",
            where=source.label,
            fix="check that every record has the same fields with the same types.",
        ) from None
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):
            raise
        raise empty_error(source) from None
    except StopIteration:  # `datasets`' json builder on a 0-byte file
        raise empty_error(source) from None
    return ds


def empty_error(source: Source) -> UserError:
    return UserError("the dataset is empty (no records).", where=source.label,
                     fix="check the file, `split` and the dataset id.")


def _from_disk(source: Source) -> Dataset:
    import datasets

    loaded = datasets.load_from_disk(source.label)
    if isinstance(loaded, datasets.DatasetDict):
        raise UserError(
            f"is a saved DatasetDict with splits {sorted(loaded)}; `path` must name one split.",
            where=source.label,
            fix=f"point `path` at one split folder, e.g. {source.label}/{next(iter(loaded))}.",
        )
    return loaded


def _from_hub(source: Source, entry: DatasetConfig) -> Dataset:
    import datasets

    from longctx_cli.hub import hub_reachable, offline_error

    if not hub_reachable():
        # No network: `datasets` in offline mode reads its cache only and fails at once.
        was = datasets.config.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = True
        try:
            return datasets.load_dataset(
                source.label, name=entry.name, split=entry.split, revision=entry.revision)
        except Exception:  # noqa: BLE001 - any failure here means "not in the cache"
            raise offline_error("dataset", source.label, "datasets") from None
        finally:
            datasets.config.HF_HUB_OFFLINE = was
    try:
        return datasets.load_dataset(
            source.label, name=entry.name, split=entry.split, revision=entry.revision,
            data_files=entry.data_files,
        )
    except Exception as exc:  # noqa: BLE001 - the hub raises many types; all are "cannot load"
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"could not load dataset {source.label!r} (split {entry.split!r}) from the "
            f"Hugging Face hub: {msg}",
            where="datasets",
            fix="check the dataset id, `name`, `split` and `revision` and your network access; "
            "for a local file use a path such as ./data.jsonl.",
        ) from None

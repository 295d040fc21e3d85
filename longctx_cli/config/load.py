"""Read a YAML file into a `Config`, turning every mistake into a one-paragraph `UserError`."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from longctx_cli.config.schema import Config, DatasetConfig
from longctx_cli.errors import UserError


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(field.alias or name)
        choices = getattr(field.validation_alias, "choices", None) or []
        keys.extend(c for c in choices if isinstance(c, str))
    return sorted(set(keys))


def _check_unknown_keys(data: dict, model: type[BaseModel], where: str, path: str) -> None:
    known = _known_keys(model)
    for key in data:
        if not isinstance(key, str):
            raise UserError(
                f"key {key!r} is not a string.",
                where=where,
                fix="write every key as a plain name, e.g. `sequence_len: 8192`.",
            )
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else "see docs/config.md for the keys."
            raise UserError(
                f"unknown key `{path}{key}`; {hint}",
                where=where,
                fix="rename or remove it.",
            )


def _location(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _explain(error: ValidationError, where: str) -> UserError:
    first = error.errors()[0]
    key = _location(tuple(x for x in first["loc"] if not str(x).startswith("function-")))
    value = first.get("input")
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return UserError(f"required key `{key}` is missing.", where=where, fix=f"add `{key}: ...`.")
    if key == "(top level)":
        return UserError(f"{msg}.", where=where)
    return UserError(
        f"`{key}` = {shown} is invalid: {msg}.",
        where=where,
        fix=f"change `{key}` (see docs/config.md for its type and allowed values).",
    )


def config_from_dict(data: Any, where: str = "config") -> Config:
    """Validate an already-parsed mapping; `where` names its origin in error messages."""
    if not isinstance(data, dict):
        raise UserError(
            f"the top level must be a mapping of keys to values, not {type(data).__name__}.",
            where=where,
            fix="write `key: value` lines, e.g. `base_model: ...` and `sequence_len: 8192`.",
        )
    _check_unknown_keys(data, Config, where, "")
    for list_key in ("datasets", "eval_datasets"):
        entries = data.get(list_key)
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    _check_unknown_keys(entry, DatasetConfig, where, f"{list_key}[{i}].")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise _explain(e, where) from None


def load_config(path: str | Path) -> Config:
    """Load and validate a YAML config file (safe_load only)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"config file {str(path)!r} does not exist.",
            fix="check the path, e.g. `longctx validate examples/tiny_passkey.yaml`.",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError("is not UTF-8 text.", where=str(path), fix="save it as UTF-8.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(
            f"invalid YAML ({problem}).",
            where=at,
            fix="check indentation and quoting on that line.",
        ) from None
    except RecursionError:
        # The YAML parser recurses once per nesting level; no config nests more than a few.
        raise UserError(
            "is nested too deeply to be a config (hundreds of levels of lists or mappings).",
            where=str(path),
            fix="check for unbalanced brackets; see examples/ for a config.",
        ) from None
    if data is None:
        raise UserError("the file is empty.", where=str(path), fix="see examples/ for a config.")
    return config_from_dict(data, where=str(path))

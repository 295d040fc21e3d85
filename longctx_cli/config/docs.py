"""Generate docs/config.md from the schema: every key with its type, default and meaning.

    python -m longctx_cli.config.docs > docs/config.md
    python -m longctx_cli.config.docs axolotl > docs/axolotl.md

Keys are grouped by the section that owns them (config/sections/), so a new field lands in
the right group without touching this file.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from longctx_cli.config.schema import SECTIONS, Config, DatasetConfig

HEADER = """\
# Configuration reference

<!-- Generated from longctx_cli/config/sections/ by
     `python -m longctx_cli.config.docs > docs/config.md`; do not edit by hand. -->

A config is one flat YAML mapping. A key that is neither longctx's nor one of the Axolotl keys
[axolotl.md](axolotl.md) lists is an error naming the nearest known keys; with `strict: false`
it is listed in the plan as ignored instead, unless it is a typo of a known key (one or two
letters away, or its start cut short): that is always an error with a "did you mean".
`longctx validate CONFIG` checks a config against the world size and the model and prints the
resolved plan; see [cli.md](cli.md).
"""


def _groups() -> dict[str, list[str]]:
    """Top-level keys by section (config/sections/), in the sections' order; `trl:` (the
    GRPO section, one nested key) beside `rl`."""
    groups: dict[str, list[str]] = {}
    for cls in SECTIONS.values():
        names = list(cls.model_fields)
        if "rl" in names:
            names.insert(names.index("rl") + 1, "trl")
        groups.setdefault(cls.title, []).extend(names)
    return groups


def type_name(annotation: Any) -> str:
    """A YAML reader's name for a Python annotation: `int`, `list of int`, `a | b`, `null`."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is list:
        inner = type_name(args[0]) if args else "any"
        if isinstance(args[0], type) and issubclass(args[0], BaseModel):
            inner = "dataset entry"
        return f"list of {inner}"
    if origin is dict:
        return "mapping"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return {"str": "string", "bool": "boolean", "int": "integer", "float": "number"}.get(
        getattr(annotation, "__name__", str(annotation)), str(annotation)
    )


def default_text(info: FieldInfo) -> str:
    """The default as it would be written in YAML."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def bounds_text(info: FieldInfo) -> str:
    """Numeric limits from the field's constraints, e.g. `>= 1, < 1`."""
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = []
    for item in info.metadata:
        for attr, op in ops.items():
            if getattr(item, attr, None) is not None:
                parts.append(f"{op} {getattr(item, attr)}")
    return ", ".join(parts)


def _key(name: str, info: FieldInfo) -> str:
    key = f"`{info.alias or name}`"
    choices = [c for c in getattr(info.validation_alias, "choices", None) or [] if c != name]
    if choices:
        key += " (alias " + ", ".join(f"`{c}`" for c in choices) + ")"
    return key


def _table(fields: dict[str, FieldInfo], names: list[str]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name in names:
        info = fields[name]
        description = (info.description or "").replace("|", "\\|")
        bounds = bounds_text(info)
        kind = type_name(info.annotation) + (f" ({bounds})" if bounds else "")
        lines.append(f"| {_key(name, info)} | {kind} | {default_text(info)} | {description} |")
    return lines


def render() -> str:
    """The whole of docs/config.md."""
    out = [HEADER]
    fields = Config.flat_fields()
    for group, names in _groups().items():
        out += [f"## {group.capitalize()}", "", *_table(fields, names), ""]
    out += [
        "## Dataset entries",
        "",
        "Each item of `datasets:` and `eval_datasets:` is a mapping with these keys.",
        "",
        *_table(DatasetConfig.model_fields, list(DatasetConfig.model_fields)),
        "",
    ]
    return "\n".join(out)


AXOLOTL_HEADER = """\
# Axolotl configs in longctx

<!-- Generated from longctx_cli/config/axolotl.py and sections/ by
     `python -m longctx_cli.config.docs axolotl > docs/axolotl.md`; do not edit by hand. -->

An Axolotl config is read as it is. Each Axolotl key is one of:

- **same**: a longctx key with the same name and meaning (see [config.md](config.md));
- **mapped**: translated onto longctx's keys; `longctx validate` lists what it became;
- **ignored**: accepted and listed in the plan; it changes nothing longctx computes;
- **refused**: it would change the math or the task and longctx cannot honour it; an error
  unless it is off (null, false, empty).

Any other key is an error naming the nearest known keys. A config that asks for leniency
with `strict: false` (as Axolotl's own examples do) has such keys listed in the plan as
ignored (newer Axolotl releases and plugins add keys faster than any table), unless it is a
known rename (older Axolotl or other trainers' names, below) or a typo of a known key (one or
two letters away, or its start cut short): then it is an error with the suggestion. A
command-line flag that is neither an option of the command nor a key is always an error.
Every problem of a file is reported at once, each at `file:line:col`.
Dataset keys (`type: alpaca`, `chat_template`, ...) are described in [data.md](data.md).
A key written with no value (`fp16:`, `deepspeed:`, as Axolotl's templates leave many) is not
set: its default applies. The one exception is `max_grad_norm:`, whose empty value means no
clipping.
"""


def render_axolotl() -> str:
    """The whole of docs/axolotl.md: every Axolotl key longctx knows, and what it does."""
    from longctx_cli.config.axolotl import AXOLOTL_KEYS, RENAMES, SAME

    rows = []
    for key in SAME:
        info = _field_by_key(key)
        ours = info.alias or _name_of(key)
        what = f"`{ours}`" if ours != key else "same key"
        rows.append((key, "same", what, (info.description or "").replace("|", "\\|")))
    for key, rule in AXOLOTL_KEYS.items():
        target = f"`{rule.target}`" if rule.kind == "mapped" and rule.target != "-" else "-"
        note = rule.reason
        if rule.values:
            note += " (values: " + ", ".join(f"`{v}`" for v in rule.values) + ")"
        status = rule.kind if key not in SAME else "same; other forms mapped"
        rows.append((key, status, target, note.replace("|", "\\|")))
    out = [AXOLOTL_HEADER, "## Keys", "", "| Axolotl key | status | longctx | note |",
           "|---|---|---|---|"]
    out += [f"| `{k}` | {s} | {t} | {n} |" for k, s, t, n in sorted(rows)]
    out += ["", *grpo_keys_section()]
    out += ["", "## Renames suggested for unknown keys", "", "| written | did you mean |",
            "|---|---|"]
    out += [f"| `{k}` | `{v}` |" for k, v in sorted(RENAMES.items())]
    survey = examples_survey()
    if survey:
        out += ["", "## Axolotl's own examples", "", survey]
    return "\n".join(out) + "\n"


GRPO_HEADER = """\
## GRPO: the `trl:` section

`rl: grpo` reads TRL's `GRPOConfig` keys under `trl:` (TRL 1.16; see [rl.md](rl.md)). Every
field TRL 1.16's `GRPOConfig` adds to `TrainingArguments` has a row here
(tests/test_grpo_keys.py checks it), with what longctx does with it:

- **honoured**: computed as TRL computes it (the loss against TRL's own `_compute_loss` in
  tests/test_grpo.py); the default is TRL's;
- **ignored**: accepted and listed in the plan; it changes nothing longctx computes (why);
- **refused**: an error naming the key, the value and the fix, unless it is at TRL's default
  (off, null, empty; `router_aux_loss_coef` also 0.0).
"""


def grpo_keys_section() -> list[str]:
    """docs/axolotl.md's table of the `trl:` keys: honoured, ignored or refused, and why."""
    from longctx_cli.config.sections.grpo import TRL_IGNORED, TRL_REFUSED, TrlConfig

    rows = [(name, "honoured", default_text(info), info.description or "")
            for name, info in TrlConfig.model_fields.items()]
    rows += [(key, "ignored", "-", why) for key, why in TRL_IGNORED.items()]
    rows += [(key, "refused", "-", why) for key, why in TRL_REFUSED.items()]
    out = [GRPO_HEADER, "| `trl:` key | longctx | default | what longctx does |",
           "|---|---|---|---|"]
    out += [f"| `{k}` | {s} | {d} | {n.replace('|', chr(92) + '|')} |"
            for k, s, d, n in sorted(rows)]
    return out


def examples_survey() -> str | None:
    """The summary of the newest `benchmarks/axolotl_examples.py` run (its results JSON),
    where this is a checkout that has one."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    runs = sorted(results.glob("axolotl-examples-*.json"))
    return json.loads(runs[-1].read_text())["summary"] if runs else None


def _name_of(key: str) -> str:
    for name, info in Config.flat_fields().items():
        choices = getattr(info.validation_alias, "choices", None) or []
        if key in (name, info.alias, *choices):
            return name
    raise KeyError(key)


def _field_by_key(key: str) -> FieldInfo:
    fields = Config.flat_fields()
    if key in DatasetConfig.model_fields and key not in fields:
        return DatasetConfig.model_fields[key]
    return fields[_name_of(key)]


def main() -> None:
    sys.stdout.write(render_axolotl() if sys.argv[1:] == ["axolotl"] else render())


if __name__ == "__main__":
    main()

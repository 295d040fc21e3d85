"""Read a YAML file (plus command-line overrides) into a `Config`.

Every problem of a file is reported at once, each at its `file:line:col`: unknown keys
(with the Axolotl rename before spelling distance), duplicate keys, wrong types and values,
and Axolotl keys that longctx refuses. Axolotl keys that longctx maps or ignores are
translated here, through the table in axolotl.py, and remembered for the plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from longctx_cli.config import axolotl
from longctx_cli.config.schema import SECTIONS, Config, DatasetConfig
from longctx_cli.errors import UserError

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the config, where it is, and how to fix it."""

    where: str
    message: str
    fix: str = ""


class _Locations:
    """`file:line:col` of every key (and value) of the YAML, and of command-line overrides."""

    def __init__(self, source: str):
        self.source = source
        self.keys: dict[Path_, str] = {}
        self.values: dict[Path_, str] = {}

    def add_node(self, node: yaml.Node, path: Path_ = ()) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key: str | int = key_node.value
                self.keys[(*path, key)] = self._at(key_node.start_mark)
                self.values[(*path, key)] = self._at(value_node.start_mark)
                self.add_node(value_node, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.keys[(*path, i)] = self.values[(*path, i)] = self._at(item.start_mark)
                self.add_node(item, (*path, i))

    def _at(self, mark: yaml.Mark) -> str:
        return f"{self.source}:{mark.line + 1}:{mark.column + 1}"

    def set_override(self, key: str, where: str) -> None:
        for table in (self.keys, self.values):
            for path in [p for p in table if p and p[0] == key]:
                del table[path]
            table[(key,)] = where

    def of(self, path: Path_, value: bool = False) -> str:
        """The closest known location of `path` (its own, else its parent's)."""
        table = self.values if value else self.keys
        for end in range(len(path), 0, -1):
            if path[:end] in table:
                return table[path[:end]]
        return self.source


class _DuplicateKeyLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate mapping keys instead of keeping the last silently."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.duplicates: list[tuple[Any, yaml.Mark, yaml.Mark]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                self.duplicates.append((key, key_node.start_mark, seen[key]))
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def known_keys(model: type[BaseModel]) -> list[str]:
    """Every key a model accepts, aliases included (a `Config`: its sections' keys)."""
    keys = []
    fields = model.flat_fields() if model is Config else model.model_fields
    for name, field in fields.items():
        keys.append(field.alias or name)
        choices = getattr(field.validation_alias, "choices", None) or []
        keys.extend(c for c in choices if isinstance(c, str))
    return sorted(set(keys))


def near_misses(key: str, known: list[str]) -> list[str]:
    """Known keys `key` is a typo of: one edit away (a letter added, dropped, changed or two
    swapped), two for keys of 8 letters or more, or the start of a longer key cut short
    (`gradient_checkpoint`); closest first.

    A looser match (shared words, a key of ours that starts another tool's key) takes other
    tools' real keys for typos: `use_scattermoe` is not a misspelt `fused_attn_kernel`, nor
    `liger_rms_norm_gated` one of `liger_rms_norm`; those are unknown keys instead."""
    limit = 2 if len(key) >= 8 else 1
    scored = sorted((d, k) for k in known if (d := _edit_distance(key, k, limit)) <= limit)
    cut_short = sorted((len(k), k) for k in known if _cut_short(key, k))
    return list(dict.fromkeys([k for _, k in scored] + [k for _, k in cut_short]))


def _cut_short(key: str, known: str) -> bool:
    """`key` is most of `known`, its end missing (8 letters or more, at least 3/4 of it)."""
    return (len(key) >= 8 and len(key) < len(known) and 4 * len(key) >= 3 * len(known)
            and known.startswith(key))


def nearest_keys(key: str, known: list[str], n: int = 3) -> list[str]:
    """The known keys most like `key` (typos first, then by similarity), for the message of
    an unknown key that is not a typo of one."""
    import difflib

    return list(dict.fromkeys([*near_misses(key, known),
                               *difflib.get_close_matches(key, known, n=n, cutoff=0.6)]))[:n]


def _edit_distance(a: str, b: str, limit: int) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) from a to b; limit + 1 once it
    is known to exceed `limit`."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    before, row = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (ca != cb))
            if before is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], before[j - 2] + 1)
        if min(current) > limit:
            return limit + 1
        before, row = row, current
    return row[-1]


def _unknown(key: str, known: list[str], path: str, where: str,
             strict: bool | None = None) -> Problem | None:
    """The problem an unknown key is: a near-miss of a known key (a typo, or an Axolotl key
    longctx names differently) always, any other unless the config asks for leniency
    (`strict: false`); None: a key the caller lists in the plan as ignored."""
    renames = {} if path else axolotl.RENAMES  # top-level names of other tools
    close = near_misses(key, [*known, *renames])  # a typo of a rename suggests its target
    rename = renames.get(key) or next(iter(close), None)
    if rename is not None:
        hint = f"did you mean `{renames.get(rename, rename)}`?"
        return Problem(where, f"unknown key `{path}{key}`; {hint}", "rename or remove it.")
    if strict is False:
        return None
    nearest = nearest_keys(key, known)
    like = ("; the nearest known keys are " + ", ".join(f"`{k}`" for k in nearest)
            if nearest else "")
    under = " (`strict: true`)" if strict is True else ""
    return Problem(where, f"unknown key `{path}{key}`{under}: neither a longctx key nor one of "
                   f"the Axolotl keys docs/axolotl.md lists{like}.",
                   "rename or remove it (docs/config.md lists the keys), or set `strict: false` "
                   "to have unknown keys listed in the plan as ignored.")


UNKNOWN_NOTE = ("ignored (`strict: false`): not a key longctx knows; without `strict: false` "
                "it is an error")


# ---- Axolotl translation ------------------------------------------------------------------

# Keys whose `null` is a value of its own rather than "not set": no gradient clipping.
NULL_MEANS_SOMETHING = frozenset({"max_grad_norm"})


def _translate(
    data: dict[Any, Any], locations: _Locations, problems: list[Problem]
) -> tuple[dict[str, Any], list[tuple[str, str]], dict[str, str]]:
    """Our keys, the plan's notes on Axolotl keys, and `our key -> the Axolotl key it came from`."""
    known = known_keys(Config)
    everything = sorted(set(known) | set(axolotl.AXOLOTL_KEYS))
    strict = data.get("strict")
    out: dict[str, Any] = {}
    notes: list[tuple[str, str]] = []
    produced: dict[str, str] = {}
    for key, value in data.items():
        where = locations.of((key,))
        if not isinstance(key, str):
            problems.append(Problem(where, f"key {key!r} is not a string.",
                                    "write every key as a plain name, e.g. `sequence_len: 8192`."))
            continue
        if value is None and key not in NULL_MEANS_SOMETHING:
            # Axolotl configs list many keys with no value (`fp16:`, `deepspeed:`): an empty
            # key is not set, and its default applies.
            continue
        if key == "model_config" and isinstance(value, dict) and "model_type" not in value and (
                data.get("base_model")):
            # Older Axolotl read `model_config` as overrides of the model's config (e.g.
            # `output_router_logits: true` in its Mixtral examples); Axolotl today ignores it.
            notes.append((key, "ignored: an older Axolotl key for overrides of the model's "
                          "config, which Axolotl no longer reads (longctx's `model_config` is a "
                          "whole inline config with `model_type`); to change the model's "
                          "config, use `overrides_of_model_config`"))
            continue
        rule = axolotl.AXOLOTL_KEYS.get(key)
        # A key of ours keeps its meaning; the table speaks only for Axolotl's other forms of
        # it (`fsdp: [full_shard, auto_wrap]` where ours is a boolean).
        if key in known and (rule is None or isinstance(value, bool)):
            out[key] = value
            continue
        if rule is None:
            problem = _unknown(key, everything, "", where, strict)
            if problem is None:
                notes.append((key, UNKNOWN_NOTE))
            else:
                problems.append(problem)
        elif rule.kind == "ignored":
            notes.append((key, f"ignored: {rule.reason}"))
        elif rule.kind == "refused":
            if axolotl.is_active(value):
                problems.append(Problem(
                    where, f"`{key}` is not supported: {rule.reason}.",
                    f"remove `{key}` (or set it to null/false).",
                ))
            else:
                notes.append((key, "ignored: off"))
        else:
            assert rule.apply is not None
            try:
                mapped, note = rule.apply(value, data)
            except axolotl.MappingProblem as e:
                problems.append(Problem(where, f"{e}.", f"correct `{key}` (docs/axolotl.md)."))
                continue
            notes.append((key, f"mapped to {note}" if mapped else note))
            for ours, ours_value in mapped.items():
                if ours in data and ours != key and data[ours] != ours_value and (
                    ours != "fsdp_config"
                ):
                    problems.append(Problem(
                        where, f"`{key}` = {value!r} means `{ours}: {ours_value}`, but the "
                        f"config also sets `{ours}: {data[ours]!r}`.", "keep one of the two.",
                    ))
                elif ours in produced and out.get(ours) != ours_value:
                    problems.append(Problem(
                        where, f"`{key}` = {value!r} means `{ours}: {ours_value}`, but "
                        f"`{produced[ours]}` means `{ours}: {out[ours]!r}`.", "keep one of them.",
                    ))
                else:
                    out[ours] = ours_value
                    produced[ours] = key
    # Both generations of the SP degree's name: the same number twice is fine.
    if "sequence_parallel_degree" in out and "context_parallel_size" in out:
        a, b = out["sequence_parallel_degree"], out.pop("context_parallel_size")
        if a != b:
            problems.append(Problem(
                locations.of(("context_parallel_size",)),
                f"`context_parallel_size` = {b!r} and `sequence_parallel_degree` = {a!r} are "
                "two names of one setting and disagree.", "keep one of them.",
            ))
    return out, notes, produced


def _dataset_keys(data: dict[str, Any], locations: _Locations, problems: list[Problem],
                  notes: list[tuple[str, str]]) -> None:
    """Report unknown keys of dataset entries (or list them as ignored, see `_unknown`);
    drop their empty keys (not set, as above)."""
    known = known_keys(DatasetConfig)
    strict = data.get("strict")
    for list_key in ("datasets", "eval_datasets"):
        entries = data.get(list_key)
        if not isinstance(entries, list):
            continue
        for i, entry in enumerate(entries):
            if isinstance(entry, dict):
                for key in [k for k, v in entry.items() if v is None]:
                    del entry[key]
                for key in [k for k in entry if isinstance(k, str) and k not in known]:
                    where = locations.of((list_key, i, key))
                    problem = _unknown(key, known, f"{list_key}[{i}].", where, strict)
                    if problem is None:
                        notes.append((f"{list_key}[{i}].{key}", UNKNOWN_NOTE))
                        del entry[key]
                    else:
                        problems.append(problem)


# ---- pydantic errors ----------------------------------------------------------------------


def _location(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _explain(
    error: ValidationError, locations: _Locations, produced: dict[str, str]
) -> list[Problem]:
    problems = []
    for item in error.errors():
        loc = tuple(x for x in item["loc"] if not str(x).startswith("function-"))
        if loc and loc[0] in SECTIONS:  # the YAML is flat: a section is no part of a key
            loc = loc[1:]
        key = _location(loc)
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden" and loc:
            parent = _location(loc[:-1])
            problems.append(Problem(
                locations.of(loc), f"unknown key `{key}`.",
                f"remove it or see docs/config.md for the keys of `{parent}`.",
            ))
            continue
        if item["type"] == "missing":
            problems.append(Problem(locations.of(loc[:-1]), f"required key `{key}` is missing.",
                                    f"add `{key}: ...`."))
            continue
        if not loc:
            # A cross-key rule: point at the first key it names that the file has.
            named = [k for k in re.findall(r"`(\w+)`", msg) if (k,) in locations.keys]
            where = locations.of((named[0],)) if named else locations.source
            problems.append(Problem(where, f"{msg}."))
            continue
        origin = produced.get(str(loc[0]))
        where = locations.of((origin,) if origin else loc, value=True)
        via = f" (from `{origin}`)" if origin else ""
        shown = repr(item.get("input"))
        if len(shown) > 80:
            shown = shown[:77] + "..."
        problems.append(Problem(
            where, f"`{key}`{via} = {shown} is invalid: {msg}.",
            f"change `{origin or key}` (see docs/config.md for its type and allowed values).",
        ))
    return problems


def _raise(problems: list[Problem], source: str) -> None:
    if len(problems) == 1:
        p = problems[0]
        raise UserError(p.message, where=p.where, fix=p.fix or None)
    lines = [f"{len(problems)} problems in the config:"]
    for p in problems:
        lines.append(f"  {p.where}: {p.message}" + (f" Fix: {p.fix}" if p.fix else ""))
    raise UserError("\n".join(lines))


# ---- entry points -------------------------------------------------------------------------


def parse_overrides(args: list[str]) -> list[tuple[str, Any, str]]:
    """`--learning-rate 2e-5 --micro-batch-size=2 --gradient-checkpointing` ->
    (key, YAML-typed value, how it was written) per override."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(
                f"unexpected argument {arg!r}.",
                fix="write overrides as `--key value` after the config, e.g. "
                "`--learning-rate 2e-5 --micro-batch-size 2`.",
            )
        name, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                text, i = args[i + 1], i + 1
            else:
                text = "true"  # a bare flag switches a boolean key on
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        out.append((name.replace("-", "_"), value, f"--{name} (command line)"))
        i += 1
    return out


def _not_a_key(key: str, where: str, options: Sequence[str]) -> Problem | None:
    """The problem an override is that names no config key (longctx's or Axolotl's) and is
    no typo of one (those are reported as the file's are), with the command's options and
    the keys it is most like."""
    known = sorted(set(known_keys(Config)) | set(axolotl.AXOLOTL_KEYS))
    if key in known:
        return None
    names = [o.removeprefix("--").replace("-", "_") for o in options]
    flags = [*near_misses(key, names), *(o for o in names if o.startswith(key))]  # --nproc
    if not flags and (key in axolotl.RENAMES or near_misses(key, [*known, *axolotl.RENAMES])):
        return None  # a typo of a key: "did you mean" below
    like = [f"`--{o.replace('_', '-')}` (an option)" for o in dict.fromkeys(flags)]
    like += [f"`--{k.replace('_', '-')}` (the key `{k}`)" for k in nearest_keys(key, known)]
    return Problem(where, f"`--{key.replace('_', '-')}` is neither an option of this command "
                   "nor a config key" + (f"; did you mean {' or '.join(like[:3])}?" if like
                                         else "."),
                   "correct it (`--help` lists the command's options, docs/config.md the keys).")


# The keys of Axolotl's cloud launcher configs (`axolotl train --cloud cloud.yaml train.yaml`:
# Modal's and Baseten's machines, volumes and secrets), none of them a training key.
CLOUD_LAUNCHER_KEYS = ("provider", "gpu", "gpu_count", "node_count", "volumes", "secrets",
                       "memory", "timeout", "memory_preprocess", "timeout_preprocess",
                       "dockerfile_commands", "docker_tag", "branch", "project_name")


def check_not_a_cloud_launcher_config(data: dict[Any, Any], where: str) -> None:
    """Refuse an Axolotl cloud launcher config, named for what it is: it describes the machine
    that runs a training config, not a training run (no `base_model`, launcher keys)."""
    if data.get("base_model") is not None or data.get("model_config") is not None:
        return
    found = [k for k in CLOUD_LAUNCHER_KEYS if k in data]
    if len(found) < 2 or not {"provider", "gpu", "volumes"} & set(found):
        return
    raise UserError(
        f"this is an Axolotl cloud launcher config (keys {', '.join(f'`{k}`' for k in found)}; "
        "no `base_model`), not a training config: Axolotl reads it beside a training config in "
        "`axolotl train --cloud <this file> <training config>` to rent the machine (Modal or "
        "Baseten), its volumes and secrets. longctx does not rent machines; it trains on the "
        "machine it runs on, with torchrun.",
        where=where,
        fix="give longctx the training config itself, and run `longctx train` on the machine "
        "you start (with its GPUs, HF_TOKEN and WANDB_API_KEY set there).")


def config_from_dict(
    data: Any,
    where: str = "config",
    *,
    _locations: _Locations | None = None,
    _problems: list[Problem] | None = None,
) -> Config:
    """Validate an already-parsed mapping; `where` names its origin in error messages."""
    if not isinstance(data, dict):
        raise UserError(
            f"the top level must be a mapping of keys to values, not {type(data).__name__}.",
            where=where,
            fix="write `key: value` lines, e.g. `base_model: ...` and `sequence_len: 8192`.",
        )
    check_not_a_cloud_launcher_config(data, where)
    locations = _locations or _Locations(where)
    problems = list(_problems or [])
    translated, notes, produced = _translate(data, locations, problems)
    _dataset_keys(translated, locations, problems, notes)
    config = None
    try:
        config = Config.model_validate(translated)
    except ValidationError as e:
        # pydantic re-reports an unknown key the checks above already named (with their
        # "did you mean"): each problem once.
        named = {(p.where, p.message.split(";")[0].rstrip(".")) for p in problems}
        problems += [p for p in _explain(e, locations, produced)
                     if (p.where, p.message.rstrip(".")) not in named]
    if problems:
        _raise(problems, locations.source)
    assert config is not None
    config.axolotl_notes[:0] = notes
    return config


def load_config(path: str | Path, overrides: list[str] | None = None,
                options: Sequence[str] = ()) -> Config:
    """Load and validate a YAML config file (safe_load only), then apply command-line
    overrides (`--key value`), validated like the file. `options`: the command's own flags
    (`--nproc-per-node`), offered when an override is neither one of them nor a config key."""
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
    locations = _Locations(str(path))
    try:
        loader = _DuplicateKeyLoader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
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
    if data is None and not overrides:
        raise UserError("the file is empty.", where=str(path), fix="see examples/ for a config.")
    if node is not None:
        locations.add_node(node)
    problems = [
        Problem(locations._at(mark), f"duplicate key `{key}` (first at line {first.line + 1}).",
                "keep one of them: YAML would silently use the last.")
        for key, mark, first in loader.duplicates
    ]
    data = {} if data is None else data
    if isinstance(data, dict) and overrides:
        data = dict(data)
        in_file = set(data)
        strict = data.get("strict") is True
        for key, value, where in parse_overrides(overrides):
            if (problem := _not_a_key(key, where, options)) is not None:
                problems.append(problem)  # a mistyped flag is never read as a config key
                continue
            if key == "strict":
                strict = value is True
            if strict and key not in in_file and key != "strict":
                problems.append(Problem(
                    where, f"`strict: true` allows overrides only of keys in the file, and "
                    f"`{key}` is not there.", f"add `{key}` to the file, or set `strict: false`.",
                ))
            data[key] = value
            locations.set_override(key, where)
    config = config_from_dict(data, where=str(path), _locations=locations, _problems=problems)
    config._source_dir = str(path.resolve().parent)  # where its `module.function`s are found
    return config

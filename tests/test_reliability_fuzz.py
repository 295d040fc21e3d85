"""Bad configs and bad data end in one clear message (exit 2) or a documented policy, never in
a traceback, and never damage a good data cache.

Configs: thousands of mutations of the bundled example go through the in-process validator
(`config_from_dict` + the plan rules), a handful through the real CLI. Data: random bytes,
truncated JSON lines, wrong field types, empty and enormous samples go through `prepare`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx_cli.config.load import config_from_dict, load_config
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.plan import build_plan
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.world import Platform, resolve_world
from longctx_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_passkey.yaml"
CPU = Platform(cuda=False, ring_flash_attn=False)


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        derandomize=True,  # the same cases on every run: a failure here is reproducible
        database=None,
    )


@cache
def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


@cache
def example_shape() -> ModelShape:
    return read_model_config(config_from_dict(example()))


def validate(data: Any) -> tuple[int, str]:
    """What `longctx validate` decides, in process: (0, "") or (2, message)."""
    try:
        config = config_from_dict(data)
        shape = (
            example_shape() if config.model.model_config_dict == example()["model_config"]
            else read_model_config(config)
        )
        world, source = resolve_world(config)  # as `validate` without flags does
        build_plan(config, world, shape, platform=CPU, world_source=source)
    except UserError as e:
        return 2, str(e)
    return 0, ""


# ---- mutations ----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "ring", "zigzag", "1e3", "yes", "", "null", "-5"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def deep(depth: int) -> Any:
    value: Any = "x"
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


def _paths(data: dict) -> list[tuple]:
    """Every key path of the example: top-level keys, model_config.*, datasets[0].*."""
    paths: list[tuple] = [(key,) for key in data]
    paths += [("model_config", key) for key in data["model_config"]]
    paths += [("datasets", 0, key) for key in data["datasets"][0]]
    return paths


def _parent(data: dict, path: tuple) -> Any:
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    return node


@st.composite
def mutated(draw) -> tuple[dict, str, str]:
    """(config, the top-level key the mutation touched, what was done)."""
    data = copy.deepcopy(example())
    path = draw(st.sampled_from(_paths(data)))
    parent = _parent(data, path)
    action = draw(st.sampled_from(["delete", "replace", "deep", "unknown", "typo"]))
    leaf = path[-1]
    if action == "delete":
        del parent[leaf]
    elif action == "replace":
        parent[leaf] = draw(values)
    elif action == "deep":
        parent[leaf] = deep(draw(st.integers(min_value=5, max_value=200)))
    elif action == "unknown":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in parent))
        parent[name] = draw(values)
        leaf = name
    else:  # a typo: the value survives under a misspelt key
        name = str(leaf) + draw(st.sampled_from(["s", "_", "x", "2"]))
        parent[name] = parent.pop(leaf)
        leaf = name
    full = path[:-1] + (leaf,)
    return data, str(full[0]), f"{action} {full}"


@fuzz(1500)
@given(mutated())
def test_mutated_configs_give_exit_0_or_a_message_naming_the_key(case):
    data, top_key, action = case
    code, message = validate(data)
    assert code in (0, 2)
    if code == 2:
        assert "Traceback" not in message and message.strip(), action
        # The key that was touched, or (deleted optional keys) the rule that now fails.
        named = top_key in message or action.startswith("delete")
        assert named, f"{action}: {message}"


@fuzz(300)
@given(st.one_of(values, st.lists(values), st.integers(), st.text()).filter(
    lambda v: not isinstance(v, dict)))
def test_non_mapping_top_level_is_explained(data):
    code, message = validate(data)
    assert code == 2 and "top level must be a mapping" in message


@fuzz(300)
@given(st.dictionaries(st.text(max_size=10) | st.integers(), values, max_size=6))
def test_random_mappings_name_a_key(data):
    code, message = validate(data)
    assert code == 2  # no required `datasets` with a valid entry: never valid
    assert "`" in message or "key" in message, message


@fuzz(400)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_random_yaml_text_loads_or_is_explained(tmp_path, text):
    path = tmp_path / "random.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        config = load_config(path)
    except UserError as e:
        assert str(e).strip() and "Traceback" not in str(e)
    else:  # only a real config is accepted
        assert config.data.datasets


def test_deeply_nested_yaml_is_explained(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("sequence_len: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    assert "nested too deeply" in str(err.value)


# ---- a handful through the real CLI ---------------------------------------------------------

# (what to change in the example, or raw file text; what the message must name)
CLI_CASES: list[tuple[dict | str, str]] = [
    ({"sequence_len": -4096}, "sequence_len"),
    ({"sequence_paralel_degree": 2}, "sequence_paralel_degree"),
    ({"model_config": {"model_type": "llama", "hidden_size": "wide"}}, "model_config"),
    ("- just\n- a list\n", "top level"),
]


def test_cli_validate_names_the_key(tmp_path):
    for i, (change, key) in enumerate(CLI_CASES):
        path = tmp_path / f"case{i}.yaml"
        text = change if isinstance(change, str) else yaml.safe_dump({**example(), **change})
        path.write_text(text)
        result = subprocess.run(
            [sys.executable, "-m", "longctx_cli", "validate", str(path)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert result.returncode == 2, (change, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert key in result.stderr, (change, result.stderr)


# ---- data -----------------------------------------------------------------------------------

GOOD_LINES = [json.dumps({"text": f"{i}: alpha beta gamma delta"}) for i in range(12)]
SEQUENCE_LEN = 128


def _data_config(data_file: Path, prepared: Path, strategy: str = "drop") -> Any:
    return config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte",
        "datasets": [{"path": str(data_file), "type": "completion", "field": "text"}],
        "sequence_len": SEQUENCE_LEN, "dataset_prepared_path": str(prepared),
        "val_set_size": 0, "excess_length_strategy": strategy,
    })


def _truncated(line: str, cut: float) -> str:
    return line[: max(1, int(len(line) * cut))]


bad_lines = st.one_of(
    st.sampled_from(GOOD_LINES),
    st.just(""),  # blank lines are skipped
    st.builds(_truncated, st.sampled_from(GOOD_LINES), st.floats(0.05, 0.95)),
    st.sampled_from([
        '{"text": ""}', '{"text": "   "}', '{"text": null}', '{"text": 5}', '{"text": ["a"]}',
        '{"text": {"a": 1}}', '{"other": "x"}', "5", '"just a string"', "[1, 2]", "{}",
    ]),
    st.integers(SEQUENCE_LEN, 20 * SEQUENCE_LEN).map(lambda n: json.dumps({"text": "a" * n})),
    st.text(max_size=30),
)
bad_files = st.one_of(
    st.lists(bad_lines, max_size=12).map(lambda lines: "\n".join(lines).encode()),
    st.binary(max_size=200),
    st.lists(st.sampled_from(GOOD_LINES), min_size=1, max_size=6).flatmap(
        lambda lines: st.binary(min_size=1, max_size=8).map(
            lambda junk: "\n".join(lines).encode() + b"\n" + b"\xff" + junk)
    ),
)


def _first_invalid_line(raw: bytes) -> int | None:
    """The 1-based line whose bytes the pre-scan rejects (bad UTF-8, JSON, non-object)."""
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            return lineno
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return lineno
        if not isinstance(record, dict):
            return lineno
    return None


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> tuple[Path, Path]:
    """(good data file, a cache built from it)."""
    from longctx_cli.data.prepare import prepare

    root = tmp_path_factory.mktemp("data_fuzz")
    good = root / "good.jsonl"
    good.write_text("\n".join(GOOD_LINES) + "\n")
    prepare(_data_config(good, root / "cache"), progress=False)
    return good, root / "cache"


@fuzz(60)
@given(raw=bad_files, strategy=st.sampled_from(["drop", "truncate", "error"]))
def test_bad_data_is_explained_or_counted_and_never_damages_the_cache(
    good_cache, tmp_path_factory, raw, strategy
):
    from longctx_cli.data.prepare import FINGERPRINT_FILE, prepare
    from longctx_cli.durable import COMPLETE_MARKER as MARKER

    good, cache = good_cache
    work = tmp_path_factory.mktemp("case")
    prepared = work / "cache"
    shutil.copytree(cache, prepared)  # a good cache from an earlier run (location-free)
    (entry,) = [p for p in prepared.iterdir() if not p.name.startswith(".")]  # <fingerprint>/
    before = (entry / FINGERPRINT_FILE).read_text()
    data_file = work / "data.jsonl"
    data_file.write_bytes(raw)
    try:
        result = prepare(_data_config(data_file, prepared, strategy), progress=False)
    except UserError as e:
        message = str(e)
        assert "Traceback" not in message
        assert str(data_file) in message or "no train samples" in message, message
        bad_line = _first_invalid_line(raw)
        if bad_line is not None:
            assert f"{data_file}:{bad_line}" in message, message
        # The earlier cache is untouched and still reused for its own data.
        assert (entry / MARKER).is_file()
        assert (entry / FINGERPRINT_FILE).read_text() == before
        assert prepare(_data_config(good, prepared), progress=False).reused
    else:
        (stats,) = result.report.datasets
        assert stats.records == stats.skipped + stats.dropped + stats.samples
        assert stats.too_long == stats.dropped + stats.truncated
        assert len(result.train) >= 1 and not result.reused
        assert all(len(row) <= SEQUENCE_LEN for row in result.train["input_ids"])
    assert not list(work.glob(".cache.tmp-*"))  # no half-written build left behind


def test_enormous_sample_follows_the_length_policy(tmp_path):
    from longctx_cli.data.prepare import prepare

    data_file = tmp_path / "big.jsonl"
    data_file.write_text("\n".join(GOOD_LINES[:3] + [json.dumps({"text": "z" * 300_000})]))
    dropped = prepare(_data_config(data_file, tmp_path / "a"), progress=False)
    (stats,) = dropped.report.datasets
    assert (stats.records, stats.too_long, stats.dropped, stats.samples) == (4, 1, 1, 3)
    truncated = prepare(_data_config(data_file, tmp_path / "b", "truncate"), progress=False)
    (stats,) = truncated.report.datasets
    assert (stats.too_long, stats.truncated, stats.samples) == (1, 1, 4)
    with pytest.raises(UserError) as err:
        prepare(_data_config(data_file, tmp_path / "c", "error"), progress=False)
    assert f"{data_file}:4" in str(err.value)

"""docs/config.md is generated from the schema and must not go stale."""

from __future__ import annotations

from pathlib import Path

from longctx_cli.config import docs
from longctx_cli.config.schema import Config, DatasetConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_config_md_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == docs.render(), (
        "docs/config.md is stale; regenerate it with "
        "`python -m longctx_cli.config.docs > docs/config.md`"
    )


def test_every_key_is_documented_with_type_default_and_description():
    top, datasets = docs.render().split("## Dataset entries")
    for fields, text in ((Config.flat_fields(), top), (DatasetConfig.model_fields, datasets)):
        for name, info in fields.items():
            key = info.alias or name
            rows = [line for line in text.splitlines() if line.startswith(f"| `{key}`")]
            assert len(rows) == 1, key
            cells = [c.strip() for c in rows[0].strip("|").split(" | ")]
            assert len(cells) == 4 and all(cells), rows[0]


def test_groups_follow_the_schema_comments():
    text = docs.render()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Model", "## Data", "## Parallelism", "## Training", "## Adapter",
        "## Preference optimisation", "## Evaluation", "## Output", "## Dataset entries",
    ]


def test_alias_and_bounds_are_shown():
    text = docs.render()
    alias = "`sequence_parallel_degree` (alias `context_parallel_size`)"
    assert f"{alias} | integer (>= 1) | `1`" in text
    assert "| `model_config` | mapping \\| null | `null` |" in text


def test_type_names():
    from typing import Literal

    assert docs.type_name(int) == "integer"
    assert docs.type_name(list[int] | None) == "list of integer \\| null"
    assert docs.type_name(Literal["a", "b"]) == "`a` \\| `b`"

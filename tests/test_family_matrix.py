"""Every family x every column of tests/family_matrix.py (sp1 vs the model's own training, the
rings and Ulysses at sp2, the torch_flash kernel on its CPU stand-in, hybrid at sp4, TP-sp at
tp2); a row trained with config settings (attention dropout off) is refused by validate
without them.

See tests/family_matrix.py for the families, features, columns and tolerances. One process
group per world size runs all its columns for every family (world 1 also trains the
references); each cell is then its own test. The columns marked `slow` there run with -m slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import family_matrix as fm
from tests.distributed import run_distributed

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
NAMES = [f.name for f in fm.FAMILIES]
FAMILY = {f.name: f for f in fm.FAMILIES}


@pytest.fixture(scope="module")
def sp1() -> dict:
    """family -> the model's own training ("reference"), feature "activity", the sp1 cell."""
    (out,) = run_distributed(fm.sp1_worker, 1, NAMES, timeout_s=600)
    return out


def _cells(sp1: dict, slow: bool) -> dict[str, dict[str, dict]]:
    """family -> column -> cell, for the multi-process cells the default run has (or not)."""
    wanted = [(f, c) for f in fm.FAMILIES for c in fm.COLUMNS
              if c.world > 1 and fm.runs_by_default(f, c) != slow]
    cells: dict[str, dict[str, dict]] = {name: {} for name in NAMES}
    for world in sorted({c.world for _, c in wanted}):
        pairs = [(f.name, c.name) for f, c in wanted if c.world == world]
        rank0 = run_distributed(fm.columns_worker, world, pairs, timeout_s=600)[0]
        for family, runs in rank0.items():
            for column, run in runs.items():
                cells[family][column] = fm.compare(run, sp1[family]["reference"])
    return cells


@pytest.fixture(scope="module")
def matrix(sp1: dict) -> dict:
    return _cells(sp1, slow=False)


@pytest.fixture(scope="module")
def slow_matrix(sp1: dict) -> dict:
    return _cells(sp1, slow=True)


def _check(cell: dict, expected: str, what: str) -> None:
    if expected.startswith("refused: "):
        assert "refused" in cell, f"{what}: expected a refusal, got {cell}"
        message = cell["refused"]
        assert expected.removeprefix("refused: ") in message and "Fix:" in message, message
        return
    assert expected == "exact", expected
    assert "refused" not in cell, f"{what}: refused: {cell.get('refused')}"
    assert cell["loss"] < fm.LOSS_TOL, (what, cell)
    assert cell["weights"] < fm.WEIGHT_TOL, (what, cell)


@pytest.mark.parametrize(("family", "column"), [
    pytest.param(f.name, c.name, id=f"{f.name}-{c.name}",
                 marks=() if fm.runs_by_default(f, c) else pytest.mark.slow)
    for f in fm.FAMILIES for c in fm.COLUMNS])
def test_family_trains_exactly(request: pytest.FixtureRequest, sp1: dict, family: str,
                               column: str) -> None:
    col = fm.COLUMN[column]
    if col.world == 1:
        cell = sp1[family][column]
    else:
        default = fm.runs_by_default(FAMILY[family], col)
        cell = request.getfixturevalue("matrix" if default else "slow_matrix")[family][column]
    want = fm.expected(FAMILY[family], col)
    _check(cell, want, f"{family} / {column}")
    if col.flash and want == "exact":
        # PyTorch's flash op (its stand-in) computed the attention; softcapped attention
        # takes the tiled matmul path (the op has no softcap), as validate says.
        calls = cell["flash_op_calls"]
        softcap = FAMILY[family].fields.get("attn_logit_softcapping") is not None
        assert (calls["forward"] > 0) != softcap and (calls["backward"] > 0) != softcap, (
            family, calls)


@pytest.mark.parametrize("family", [f.name for f in fm.FAMILIES if f.features])
def test_each_feature_is_active_at_the_tested_length(sp1: dict, family: str) -> None:
    # Switching a feature off must change the model's own loss far beyond the tolerance;
    # otherwise the matrix could not tell a longctx that drops it from one that honours it.
    for feature, change in sp1[family]["activity"].items():
        assert change > 10 * fm.LOSS_TOL, (family, feature, change)


@pytest.mark.parametrize("family", [f.name for f in fm.FAMILIES if f.settings])
def test_validate_refuses_a_row_without_its_settings(family: str) -> None:
    # A row trained with config settings (e.g. attention dropout switched off) is one that
    # validate refuses without them, in one paragraph that names them as the fix.
    from longctx_cli.config.model_shape import read_model_config
    from longctx_cli.config.plan import build_plan
    from longctx_cli.config.world import Platform
    from longctx_cli.errors import UserError

    row = next(f for f in fm.FAMILIES if f.name == family)
    bare = fm.make_config(row, row.refused_with).model_copy(update=dict.fromkeys(row.settings))
    world = row.refused_with.get("sequence_parallel_degree", 1)
    with pytest.raises(UserError) as err:
        build_plan(bare, world, read_model_config(bare),
                   platform=Platform(cuda=False, ring_flash_attn=False))
    message = str(err.value)
    assert "\n" not in message and "Fix:" in message
    for key, value in row.settings.items():
        assert fm._settings_text({key: value}).strip("`") in message, message
    with_settings = fm.make_config(row, row.refused_with)
    build_plan(with_settings, world, read_model_config(with_settings),
               platform=Platform(cuda=False, ring_flash_attn=False))


def test_families_md_is_generated_from_the_matrix() -> None:
    assert DOC.read_text(encoding="utf-8") == fm.render(), (
        "docs/families.md is stale; regenerate it with "
        "`python -m tests.family_matrix > docs/families.md`"
    )

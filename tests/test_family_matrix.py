"""Every family x {sp1 vs the model's own training, ring sp2, ring zigzag sp2, the P2P rings
at sp2 (stripe: the default ring; ring; zigzag), Ulysses sp2}; a row trained with config
settings (attention dropout off) is refused by validate without them.

See tests/family_matrix.py for the families, features and tolerances. Two process groups run
the whole matrix (one of world 1, one of world 2); each cell is then its own test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import family_matrix as fm
from tests.distributed import run_distributed

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
NAMES = [f.name for f in fm.FAMILIES]


@pytest.fixture(scope="module")
def matrix() -> dict:
    (sp1,) = run_distributed(fm.sp1_worker, 1, NAMES, timeout_s=600)
    rank0, _ = run_distributed(fm.sp2_worker, 2, NAMES, timeout_s=600)
    for name, runs in rank0.items():
        for strategy, run in runs.items():
            sp1[name][strategy] = fm.compare(run, sp1[name]["reference"])
    return sp1


def _check(cell: dict, expected: str, what: str) -> None:
    if expected == "refused":
        assert "refused" in cell, f"{what}: expected a refusal, got {cell}"
        message = cell["refused"]
        assert "fidelity probe refuses model type" in message and "Fix:" in message, message
        return
    assert "refused" not in cell, f"{what}: refused by the fidelity probe: {cell.get('refused')}"
    assert cell["loss"] < fm.LOSS_TOL, (what, cell)
    assert cell["weights"] < fm.WEIGHT_TOL, (what, cell)


@pytest.mark.parametrize("strategy", list(fm.STRATEGIES))
@pytest.mark.parametrize("family", NAMES)
def test_family_trains_exactly(matrix: dict, family: str, strategy: str) -> None:
    _check(matrix[family][strategy], fm.EXPECTED[family], f"{family} / {strategy}")


@pytest.mark.parametrize("family", [f.name for f in fm.FAMILIES if f.features])
def test_each_feature_is_active_at_the_tested_length(matrix: dict, family: str) -> None:
    # Switching a feature off must change the model's own loss far beyond the tolerance;
    # otherwise the matrix could not tell a longctx that drops it from one that honours it.
    for feature, change in matrix[family]["activity"].items():
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
    bare = fm.make_config(row).model_copy(update=dict.fromkeys(row.settings))
    with pytest.raises(UserError) as err:
        build_plan(bare, 1, read_model_config(bare), platform=Platform(cuda=False,
                                                                       ring_flash_attn=False))
    message = str(err.value)
    assert "\n" not in message and "Fix:" in message
    for key, value in row.settings.items():
        assert fm._settings_text({key: value}).strip("`") in message, message
    with_settings = fm.make_config(row)
    build_plan(with_settings, 1, read_model_config(with_settings),
               platform=Platform(cuda=False, ring_flash_attn=False))


def test_families_md_is_generated_from_the_matrix() -> None:
    assert DOC.read_text(encoding="utf-8") == fm.render(), (
        "docs/families.md is stale; regenerate it with "
        "`python -m tests.family_matrix > docs/families.md`"
    )

"""Tiled fixed-size towers (SmolVLM, InternVL) under SP equal the model's own training.

Each image is several tower inputs (its tiles, then a thumbnail), each tile's tokens after
a marker. The towers encode every tile on its own (SmolVLM's SigLIP and InternVL's ViT take
the tiles as a batch, its connector pixel-shuffles each tile alone), so the rebuilt forward
splits the row's tiles over the ranks, gathers the features and merges each rank's own. The
packed row (tests/vlm_models.py) holds three documents, an image cut by a shard boundary:
the loss and every gradient equal each document's own `forward(pixel_values=, labels=)`.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import TOL, _longctx, _reference
from tests.vlm_models import TILED_FAMILIES

TOWERS = ("vision_model", "vision_tower", "connector", "multi_modal_projector")


def _compare(family: str, state) -> dict:
    loss, grads, calls, facts = _longctx(family, state)
    ref_loss, ref_grads = _reference(family)
    assert set(ref_grads) == set(grads), set(ref_grads) ^ set(grads)
    floor = 1e-4 * max(float(g.norm()) for g in ref_grads.values())
    errors = {n: float((grads[n] - g).norm()) / max(float(g.norm()), floor)
              for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    tower = [n for n in ref_grads if any(t in n for t in TOWERS)]
    return {"loss": abs(loss - ref_loss) / ref_loss, "grad": errors[worst], "worst": worst,
            "calls": calls, "tower_grad": min(float(ref_grads[n].norm()) for n in tower
                                               if "weight" in n and "norm" not in n),
            **facts}


def _check(name: str, r: dict) -> None:
    assert r["loss"] < TOL and r["grad"] < TOL, (name, r)
    assert r["calls"] >= 2, (name, r)  # every layer went through the SP attention
    assert r["tower_grad"] > 0, (name, r)  # every tower weight is trained


@pytest.mark.parametrize("family", TILED_FAMILIES)
def test_sp1_equals_the_models_own_training(family: str) -> None:
    _check(family, _compare(family, sp_state(sp=1, kernel="torch")))


def _worker(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for spec in (dict(mode="ulysses"), dict(mode="ring")):
        state = sp_state(sp=world, kernel="torch", **spec)
        for family in TILED_FAMILIES:
            out[f"{family} {spec}"] = _compare(family, state)
    return out


def test_sp2_ulysses_and_rings_equal_the_models_own_training() -> None:
    ranks = run_distributed(_worker, 2, timeout_s=240)
    for results in ranks:
        for name, r in results.items():
            _check(name, r)
    for family in TILED_FAMILIES:  # a shard boundary cuts an image (between or in tiles)
        assert any(r[name]["cut_image"] for r in ranks for name in r
                   if name.startswith(f"{family} ")), ranks


def test_the_tiles_are_encoded_one_by_one() -> None:
    """What splitting by tiles rests on: a tile's features do not depend on the tiles
    encoded with it (the model's own `get_image_features`, tiles apart and together)."""
    from longctx_cli.runtime.vision import VisionInputs, VisionLanguageForward
    from tests.vlm_models import image_row, tiny_vlm

    for family in TILED_FAMILIES:
        vlm = VisionLanguageForward(tiny_vlm(family, "eager").eval())
        media = image_row(family)[3]
        with torch.no_grad():
            together = vlm.encode(media)[0]
            apart = torch.cat([vlm.encode(VisionInputs(media.pixel_values[i:i + 1]))[0]
                               for i in range(media.num_images)])
        torch.testing.assert_close(together, apart, rtol=1e-4, atol=1e-5)  # batched matmuls round


@pytest.mark.parametrize("family", TILED_FAMILIES)
def test_the_fidelity_probe_passes_on_the_family_defaults(family: str) -> None:
    from transformers import AutoConfig

    from longctx_cli.checks.fidelity import run_probe

    result = run_probe(AutoConfig.for_model(family), images=True)
    assert result.summary().startswith("passed") and "images" in result.summary()
    assert result.worst_gradient_rel_error < 1e-4 and result.gradients_checked > 50


def test_the_plan_splits_the_tower_by_tiles() -> None:
    from tests.test_vlm_plan import _plan, _rows
    from tests.vlm_models import _config

    for family in TILED_FAMILIES:
        rows = _rows(_plan(_config(family), processor_type="AutoProcessor"))
        assert "2 layers, hidden 32" in rows["vision tower"]
        assert rows["tower splits by"].startswith("whole tiles") and "SP group of 2" in \
            rows["tower splits by"], rows
        # A row of only image tokens: 4096 tokens x 4 patches each (2 x 2 shuffled), 2 ranks.
        assert "8,192 patches per rank" in rows["tower memory"], rows

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


def _lora_compare(family: str, state) -> dict:
    """The run's own build (`longctx train`'s model: LoRA, `freeze_mm_modules`) against peft
    on the model's own forward, with the tower and connector frozen whole."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.model import decoder_and_head
    from tests.test_vlm_runtime import _built
    from tests.vlm_models import image_row, own_vlm_step, tiny_vlm

    ours = _built(family, state)
    decoder, head = decoder_and_head(ours, images=True)
    ids, pos, labels, images, docs = image_row(family)
    batch = decoder.shard(ids, pos, labels, images, state)
    count = sum(int((d_labels[1:] != IGNORE_INDEX).sum()) for _, d_labels, _ in docs)
    (lm_loss_sum(head, decoder.hidden_states(batch), batch.shift_labels) / count).backward()
    reference = tiny_vlm(family, "eager")
    for name in TOWERS:
        if hasattr(reference.model, name):
            getattr(reference.model, name).requires_grad_(False)
    reference = get_peft_model(reference, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        exclude_modules=rf".*({'|'.join(TOWERS)}).*", task_type="CAUSAL_LM"))
    reference.load_state_dict(ours.state_dict())
    own_vlm_step(reference, docs)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    ref = dict(reference.named_parameters())
    assert trained.keys() == {n for n, p in ref.items() if p.requires_grad}
    assert not any(t in n for n in trained for t in TOWERS), sorted(trained)
    errors = {}
    for name, p in trained.items():
        g = p.grad.clone()
        dist.all_reduce(g, group=state.sp_group)
        errors[name] = float((g - ref[name].grad).norm()) / max(float(ref[name].grad.norm()),
                                                                1e-8)
    return {"grad": max(errors.values()), "lora_b": sum("lora_B" in n for n in trained)}


def _lora_worker(rank: int, world: int) -> dict[str, dict]:
    # SmolVLM: its tower, connector and language model have names of their own
    # (`vision_model`, `connector`, `text_model`); InternVL's are LLaVA's, tested there.
    state = sp_state(sp=world, kernel="torch", mode="ulysses")
    return {"smolvlm": _lora_compare("smolvlm", state)}


def test_lora_with_frozen_tower_equals_the_models_own_training() -> None:
    for results in run_distributed(_lora_worker, 2, timeout_s=240):
        for family, r in results.items():
            assert r["grad"] < TOL and r["lora_b"] >= 4, (family, r)

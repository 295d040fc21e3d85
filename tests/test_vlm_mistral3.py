"""Mistral 3 (a Pixtral tower) with images under SP equals its own Hugging Face training.

One packed row of three documents (two images of different sizes in the first, none in the
second, one more in the third), each image's tokens in its processor's layout ([IMG] rows
broken by [IMG_BREAK], ended by [IMG_END]); at sp 2 the contiguous slicings (Ulysses, a
ring) cut the first image. The tower is split by whole images (Pixtral attends within each
image only), its features gathered and merged into each rank's tokens: the loss and every
gradient (language model, projector with its patch merger, tower) equal each document's own
`Mistral3ForConditionalGeneration(pixel_values=, image_sizes=, labels=)`.
"""

from __future__ import annotations

import pytest

from longctx_cli.families import VISION_FAMILIES, family
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import _check, _compare

SPECS = (dict(mode="ulysses"), dict(mode="ring"), dict(mode="ring", layout="zigzag"))


def test_mistral3_is_rebuilt_with_images_of_their_own_size() -> None:
    record = family("mistral3")
    assert "mistral3" in VISION_FAMILIES and record.vision_refusal is None
    assert record.vision.pixels == "sized" and record.vision.positions == "text"
    assert record.trains_text  # its text rows still train through its own class


def test_sp1_equals_the_models_own_training() -> None:
    _check({"mistral3": _compare("mistral3", sp_state(sp=1, kernel="torch"))})


def _worker(rank: int, world: int) -> dict[str, dict]:
    return {f"mistral3 sp{world} {spec}": _compare("mistral3", sp_state(
        sp=world, kernel="torch", **spec)) for spec in SPECS}


def test_sp2_ulysses_and_rings_equal_the_models_own_training() -> None:
    ranks = run_distributed(_worker, 2, timeout_s=240)
    for results in ranks:
        _check(results)
        assert len(results) == len(SPECS)
        # The first image is cut by the shard boundary of the contiguous slicings.
        assert all(r["cut_image"] for name, r in results.items()
                   if "zigzag" not in name), results


def _worker4(rank: int, world: int) -> dict[str, dict]:
    state = sp_state(sp=4, kernel="torch", mode="hybrid", ulysses_degree=2)
    return {"mistral3 sp4 hybrid": _compare("mistral3", state)}


@pytest.mark.slow  # hybrid sp 4 of the VLM path runs by default in test_vlm_runtime.py
def test_sp4_hybrid_equals_the_models_own_training() -> None:
    # Four ranks, three images: one rank encodes none (it runs the tower on a blank).
    for results in run_distributed(_worker4, 4, timeout_s=300):
        _check(results)


def test_decoding_after_images_of_two_sizes_under_sp_equals_generate() -> None:
    from tests.test_vlm_runtime import _generate_worker

    for result in run_distributed(_generate_worker, 2, "mistral3", timeout_s=240):
        assert result["ring"] == result["ulysses"] == result["generate"], result


def test_an_image_of_one_token_alone_and_a_blank_tower_call() -> None:
    """A rank whose run of images makes one token in all (transformers' get_image_features
    squeezes such a call's token axis away) still gets that token's features, as encoded
    beside the other images; the blank tower call of a text-only row runs too."""
    import torch

    from longctx_cli.runtime.vision import VisionLanguageForward
    from tests.vlm_models import image_row, tiny_vlm

    vlm = VisionLanguageForward(tiny_vlm("mistral3", "eager"))
    media = image_row("mistral3")[4][0][2]  # the first document's 32x24 and 8x8 images
    with torch.no_grad():
        both, _ = vlm.encode(media)
        alone, _ = vlm.encode(media.subset(1, 2))  # 8x8 pixels: one merged 2 x 2 patch
        zero = vlm._tower_zero(torch.device("cpu"))
    assert both.shape[0] == 12 + 1 and alone.shape[0] == 1
    torch.testing.assert_close(alone, both[-1:], rtol=1e-5, atol=1e-5)
    assert float(zero) == 0


def _lora_worker(rank: int, world: int) -> dict:
    from tests.test_vlm_runtime import _lora_compare

    return _lora_compare("mistral3", sp_state(sp=world, kernel="torch", mode="ulysses"))


@pytest.mark.slow  # LoRA with a frozen tower runs by default in test_vlm_runtime.py
def test_lora_with_frozen_tower_equals_the_models_own_training() -> None:
    # The run's own build (`adapter: lora`, `freeze_mm_modules`) at sp 2 against peft's LoRA
    # on the model's own forward, tower and projector frozen.
    for r in run_distributed(_lora_worker, 2, timeout_s=240):
        assert r["grad"] < 2e-5 and r["lora_b"] >= 4 and r["lora_b_norm"] > 0, r

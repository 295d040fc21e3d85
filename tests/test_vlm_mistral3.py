"""Mistral 3 (a Pixtral tower) with images under SP equals its own Hugging Face training.

One packed row of three documents (two images of different sizes in the first, none in the
second, one more in the third), each image's tokens in its processor's layout ([IMG] rows
broken by [IMG_BREAK], ended by [IMG_END]); at sp 2 the contiguous
slicings (Ulysses, a ring) cut the first image. The
tower is split by whole images (Pixtral attends within each image only), its features
gathered and merged into each rank's tokens: the loss and every gradient (language model,
projector with its patch merger, tower) equal each document's own
`Mistral3ForConditionalGeneration(pixel_values=, image_sizes=, labels=)`.
"""

from __future__ import annotations

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

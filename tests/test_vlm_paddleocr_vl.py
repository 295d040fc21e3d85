"""PaddleOCR-VL with images under SP equals the model's own Hugging Face training.

Its tower is SigLIP-style (one-frame patches of `[3, side, side]` pixels, attention within
each image, positions interpolated per image) and its projector merges each image's 2 x 2
patches, so the tower splits by whole images as Qwen-VL's does; its text positions are
3-D mRoPE from its own `get_rope_index`. The row of tests/test_vlm_glm46v.py (an image cut
by every sp-2 layout's shard boundary) under a ring, a zigzag ring and Ulysses gives the
loss and every gradient of each document's own `forward(pixel_values=, image_grid_thw=,
labels=)`. Its videos are refused (it takes images only).
"""

from __future__ import annotations

import pytest

from longctx_cli.errors import UserError
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.runtime.vision import IMAGE, VIDEO, VisionInputs, VisionLanguageForward
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_glm46v import GLM_DOCUMENTS, LAYOUTS
from tests.test_vlm_runtime import _check, _compare
from tests.vlm_models import image_row, tiny_vlm


def _worker(rank: int, world: int) -> dict[str, dict]:
    return {str(spec): _compare("paddleocr_vl", sp_state(sp=world, kernel="torch", **spec),
                                GLM_DOCUMENTS) for spec in LAYOUTS}


def test_paddleocr_vl_sp1_equals_the_models_own_training() -> None:
    _check({"sp1": _compare("paddleocr_vl", sp_state(sp=1, kernel="torch"), GLM_DOCUMENTS)})


def test_paddleocr_vl_sp2_ring_and_ulysses_equal_the_models_own_training() -> None:
    ranks = run_distributed(_worker, 2, timeout_s=240)
    for results in ranks:
        _check(results)
    for spec in LAYOUTS:  # every layout's shard boundary cuts an image
        assert any(r[str(spec)]["cut_image"] for r in ranks), (spec, ranks)


def test_paddleocr_vl_row_with_a_video_is_refused() -> None:
    vlm = VisionLanguageForward(tiny_vlm("paddleocr_vl", register_sp_attention()))
    ids, pos, labels, media, _ = image_row("paddleocr_vl", specs=GLM_DOCUMENTS)
    row = VisionInputs(media.pixel_values, media.image_grid_thw, (IMAGE, IMAGE, VIDEO))
    batch = vlm.shard(ids, pos, labels, row, sp_state(sp=1, kernel="torch"))
    with pytest.raises(UserError, match="takes images only"):
        vlm.hidden_states(batch)

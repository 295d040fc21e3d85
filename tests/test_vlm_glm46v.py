"""GLM-4.6V with images under SP equals the model's own Hugging Face training.

A packed row of three documents (two images in the first, one of them cut by the shard
boundary of every sp-2 layout; text only; one image) through longctx's rebuilt forward
(runtime/vision.py: its merged patch tower split by whole images, features gathered, mRoPE
positions from the model's own `get_rope_index` per document, then sliced) under a ring, a
zigzag ring and Ulysses: the loss and every gradient (language model, tower, merger) equal
each document's own `forward(input_ids=, pixel_values=, image_grid_thw=, labels=)`.
Its videos are refused (families.py `video_refusal`), not trained as images.
"""

from __future__ import annotations

import pytest
import torch

from longctx_cli.errors import UserError
from longctx_cli.families import vision_family
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.runtime.vision import IMAGE, VIDEO, VisionInputs, VisionLanguageForward
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import _check, _compare
from tests.vlm_models import image_row, tiny_vlm

# 37 + 9 + 10 = 56 tokens: the first image is tokens 13-28, so the contiguous halves' boundary
# (28) and the zigzag ring's first rank change (14) both fall inside it.
GLM_DOCUMENTS = ((12, (1, 8, 8), 2, (1, 2, 2), 2), (9,), (3, (1, 4, 2), 3))
LAYOUTS = (dict(mode="ring"), dict(mode="ring", layout="zigzag"), dict(mode="ulysses"))


def _worker(rank: int, world: int) -> dict[str, dict]:
    return {str(spec): _compare("glm46v", sp_state(sp=world, kernel="torch", **spec),
                                GLM_DOCUMENTS) for spec in LAYOUTS}


def test_glm46v_sp1_equals_the_models_own_training() -> None:
    _check({"sp1": _compare("glm46v", sp_state(sp=1, kernel="torch"), GLM_DOCUMENTS)})


def test_glm46v_sp2_ring_and_ulysses_equal_the_models_own_training() -> None:
    ranks = run_distributed(_worker, 2, timeout_s=240)
    for results in ranks:
        _check(results)
    for spec in LAYOUTS:  # every layout's shard boundary cuts an image
        assert any(r[str(spec)]["cut_image"] for r in ranks), (spec, ranks)


def test_glm46v_row_with_a_video_is_refused() -> None:
    model = tiny_vlm("glm46v", register_sp_attention())
    vlm = VisionLanguageForward(model)
    ids, pos, labels, media, _ = image_row("glm46v", specs=GLM_DOCUMENTS)
    kinds = (IMAGE, IMAGE, VIDEO)  # the last item read as a video
    row = VisionInputs(media.pixel_values, media.image_grid_thw, kinds)
    batch = vlm.shard(ids, pos, labels, row, sp_state(sp=1, kernel="torch"))
    with pytest.raises(UserError, match="video") as e:
        vlm.hidden_states(batch)
    assert vision_family("glm46v").video_refusal in str(e.value)
    assert torch.is_tensor(ids)

"""PaddleOCR-VL with images under SP equals the model's own Hugging Face training.

Its tower is SigLIP-style (one-frame patches of `[3, side, side]` pixels, attention within
each image, positions interpolated per image) and its projector merges each image's 2 x 2
patches, so the tower splits by whole images as Qwen-VL's does; its text positions are
3-D mRoPE from its own `get_rope_index`. The row of tests/test_vlm_glm46v.py (an image cut
by every sp-2 layout's shard boundary) under a ring, a zigzag ring and Ulysses gives the
loss and every gradient of each document's own `forward(pixel_values=, image_grid_thw=,
labels=)`. Its videos are refused (it takes images only). Its processor's rows (patches
stored as rows, reshaped back for its tower) equal what transformers' `PaddleOCRVLProcessor`
makes of the same record, and `validate` passes it with images.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import vision
from longctx_cli.errors import UserError
from longctx_cli.families import vision_family
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.runtime.vision import IMAGE, VIDEO, VisionInputs, VisionLanguageForward
from tests.layouts import sp_state
from tests.test_vlm_glm46v import GLM_DOCUMENTS, _images, check_every_layout
from tests.test_vlm_runtime import _check, _compare
from tests.vlm_fixtures import conversation, write_tiny_paddleocr_vl_processor
from tests.vlm_models import image_row, tiny_vlm


def test_paddleocr_vl_sp1_equals_the_models_own_training() -> None:
    _check({"sp1": _compare("paddleocr_vl", sp_state(sp=1, kernel="torch"), GLM_DOCUMENTS)})


def test_paddleocr_vl_sp2_ring_and_ulysses_equal_the_models_own_training() -> None:
    check_every_layout("paddleocr_vl")


def test_paddleocr_vl_row_with_a_video_is_refused() -> None:
    vlm = VisionLanguageForward(tiny_vlm("paddleocr_vl", register_sp_attention()))
    ids, pos, labels, media, _ = image_row("paddleocr_vl", specs=GLM_DOCUMENTS)
    row = VisionInputs(media.pixel_values, media.image_grid_thw, (IMAGE, IMAGE, VIDEO))
    batch = vlm.shard(ids, pos, labels, row, sp_state(sp=1, kernel="torch"))
    with pytest.raises(UserError, match="takes images only"):
        vlm.hidden_states(batch)


def test_paddleocr_vl_rows_equal_its_processors_own(tmp_path) -> None:
    from PIL import Image
    from transformers import PaddleOCRVLImageProcessorPil, PaddleOCRVLProcessor

    vp = vision.load_processor(str(write_tiny_paddleocr_vl_processor(tmp_path / "proc")))
    assert isinstance(vp.processor, PaddleOCRVLProcessor)
    assert type(vp.image_processor) is PaddleOCRVLImageProcessorPil
    assert vp.family is vision_family("paddleocr_vl") and vp.video_token is None
    paths = _images(tmp_path)
    doc = vision.encode_vision_record(conversation(), vp, "d.jsonl:1", base_dir=tmp_path)
    text = vp.processor.apply_chat_template(conversation()["messages"], tokenize=False)
    ref = vp.processor(text=[text], images=[Image.open(p).convert("RGB") for p in paths],
                       return_mm_token_type_ids=True, return_tensors="np")
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert doc.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
    assert ref["pixel_values"].shape[1:] == (3, 14, 14)  # its patches, stored as rows
    np.testing.assert_array_equal(doc.pixel_values,
                                  ref["pixel_values"].reshape(doc.pixel_values.shape))
    assert doc.image_grid_thw == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    vocab = vp.tokenizer.get_vocab()
    never = {vocab[t] for t in ("<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>")}
    assert all(lab == IGNORE_INDEX for t, lab in zip(doc.input_ids, doc.labels, strict=True)
               if t in never)
    assert any(lab != IGNORE_INDEX for lab in doc.labels)


def test_validate_passes_paddleocr_vl_with_images(tmp_path) -> None:
    import yaml
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    proc = write_tiny_paddleocr_vl_processor(tmp_path / "proc")
    _images(tmp_path)
    (tmp_path / "d.jsonl").write_text(json.dumps(conversation()) + "\n")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model_config": AutoConfig.for_model("paddleocr_vl").to_dict(),
        "processor_type": "AutoProcessor", "processor_path": str(proc), "sequence_len": 2048,
        "sequence_parallel_degree": 2,
        "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "chat_template"}]}))
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "c.yaml"),
                                      "--nproc-per-node", "2"])
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "3 images decoded" in out, out
    assert "passed: tiny random `paddleocr_vl`" in out and "tower split by images" in out

"""GLM-4.6V with images under SP equals the model's own Hugging Face training.

A packed row of three documents (two images in the first, one of them cut by the shard
boundary of every sp-2 layout; text only; one image) through longctx's rebuilt forward
(runtime/vision.py: its merged patch tower split by whole images, features gathered, mRoPE
positions from the model's own `get_rope_index` per document, then sliced) under a ring, a
zigzag ring and Ulysses: the loss and every gradient (language model, tower, merger) equal
each document's own `forward(input_ids=, pixel_values=, image_grid_thw=, labels=)`.
Its videos are refused (families.py `video_refusal`), not trained as images. Its
processor's rows (data/vision, with GLM's own image processor and `<|image|>` placeholder)
equal what transformers' `Glm46VProcessor` makes of the same record.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import vision
from longctx_cli.errors import UserError
from longctx_cli.families import vision_family
from longctx_cli.parallel.attention import register_sp_attention
from longctx_cli.runtime.vision import IMAGE, VIDEO, VisionInputs, VisionLanguageForward
from tests.distributed import run_distributed
from tests.layouts import sp_state
from tests.test_vlm_runtime import _check, _compare, _generate_worker
from tests.vlm_fixtures import conversation, make_image, write_tiny_glm46v_processor
from tests.vlm_models import image_row, tiny_vlm

# 37 + 9 + 10 = 56 tokens: the first image is tokens 13-28, so the contiguous halves' boundary
# (28) and the zigzag ring's first rank change (14) both fall inside it.
GLM_DOCUMENTS = ((12, (1, 8, 8), 2, (1, 2, 2), 2), (9,), (3, (1, 4, 2), 3))
LAYOUTS = (dict(mode="ring"), dict(mode="ring", layout="zigzag"), dict(mode="ulysses"))


def layouts_worker(rank: int, world: int, family: str) -> dict[str, dict]:
    """``family``'s loss and gradients against its own training, one result per layout."""
    return {str(spec): _compare(family, sp_state(sp=world, kernel="torch", **spec),
                                GLM_DOCUMENTS) for spec in LAYOUTS}


def check_every_layout(family: str) -> None:
    """Every layout at sp 2 exact, and in each a shard boundary cuts an image."""
    ranks = run_distributed(layouts_worker, 2, family, timeout_s=240)
    for results in ranks:
        _check(results)
    for spec in LAYOUTS:
        assert any(r[str(spec)]["cut_image"] for r in ranks), (spec, ranks)


def _older_glm_worker(rank: int, world: int) -> dict[str, dict]:
    """GLM-4.1V and GLM-4.5V (MoE layers), the same forward: a zigzag ring and Ulysses."""
    return {f"{family} {spec}": _compare(family, sp_state(sp=world, kernel="torch", **spec),
                                         GLM_DOCUMENTS)
            for family in ("glm4v", "glm4v_moe") for spec in LAYOUTS[1:]}


def test_glm4v_and_glm4v_moe_sp2_equal_the_models_own_training() -> None:
    ranks = run_distributed(_older_glm_worker, 2, timeout_s=240)
    for results in ranks:
        _check(results)
    assert all(any(r[name]["cut_image"] for r in ranks) for name in ranks[0]), ranks


def test_glm46v_sp1_equals_the_models_own_training() -> None:
    _check({"sp1": _compare("glm46v", sp_state(sp=1, kernel="torch"), GLM_DOCUMENTS)})


def test_glm46v_sp2_ring_and_ulysses_equal_the_models_own_training() -> None:
    check_every_layout("glm46v")


def test_glm46v_decoding_after_images_under_sp_equals_generate() -> None:
    """Greedy tokens after a prompt with two images (ring and Ulysses at sp 2): the model's
    own `generate`'s, whose mRoPE continues from the prompt's largest position."""
    for result in run_distributed(_generate_worker, 2, "glm46v", timeout_s=240):
        assert result["ring"] == result["ulysses"] == result["generate"], result


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


# ---- its processor's rows ------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm_vp(tmp_path_factory):
    return vision.load_processor(str(write_tiny_glm46v_processor(
        tmp_path_factory.mktemp("glm"))))


def _images(folder: Path) -> list[Path]:
    # b.png is 20 pixels wide: GLM's resize (a 10 x 2 patch grid) is not Qwen's (8 x 2).
    return [make_image(folder, "img/a.png", (84, 56), 1),
            make_image(folder, "img/b.png", (20, 100), 2),
            make_image(folder, "img/c.png", (300, 20), 3)]


@pytest.mark.parametrize("version, model_type", [("Glm46V", "glm46v"), ("Glm4v", "glm4v")])
def test_glm46v_rows_equal_its_processors_own(version, model_type, tmp_path) -> None:
    import transformers
    from PIL import Image

    glm_vp = vision.load_processor(str(write_tiny_glm46v_processor(tmp_path / "p", version)))
    # Built without torchvision, with the family's own image processor.
    assert isinstance(glm_vp.processor, getattr(transformers, f"{version}Processor"))
    assert type(glm_vp.image_processor) is getattr(transformers, f"{version}ImageProcessorPil")
    assert glm_vp.family is vision_family(model_type) and glm_vp.image_token == "<|image|>"
    paths = _images(tmp_path)
    doc = vision.encode_vision_record(conversation(), glm_vp, "d.jsonl:1", base_dir=tmp_path)
    text = glm_vp.processor.apply_chat_template(conversation()["messages"], tokenize=False)
    ref = glm_vp.processor(text=[text], images=[Image.open(p).convert("RGB") for p in paths],
                           return_mm_token_type_ids=True, return_tensors="np")
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert doc.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])
    assert doc.image_grid_thw == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    assert doc.image_grid_thw == [(1, 4, 6), (1, 10, 2), (1, 2, 30)]
    # Targets: the answers only; images and their markers never.
    vocab = glm_vp.tokenizer.get_vocab()
    never = {vocab[t] for t in ("<|image|>", "<|begin_of_image|>", "<|end_of_image|>")}
    assert all(lab == IGNORE_INDEX for t, lab in zip(doc.input_ids, doc.labels, strict=True)
               if t in never)
    assert any(lab != IGNORE_INDEX for lab in doc.labels)


def test_glm46v_markers_are_never_targets_even_on_trained_inputs(glm_vp, tmp_path) -> None:
    from longctx_cli.data.vision.records import default_spec

    _images(tmp_path)
    spec = replace(default_spec(glm_vp), train_on_inputs=True)
    doc = vision.encode_vision_record(conversation(), glm_vp, "d.jsonl:1", base_dir=tmp_path,
                                      spec=spec)
    vocab = glm_vp.tokenizer.get_vocab()
    markers = {vocab["<|begin_of_image|>"], vocab["<|end_of_image|>"]}
    assert markers <= set(doc.input_ids)
    assert all(lab == IGNORE_INDEX for t, lab in zip(doc.input_ids, doc.labels, strict=True)
               if t in markers)


def test_glm46v_record_with_a_video_is_refused(glm_vp, tmp_path) -> None:
    frames = [make_image(tmp_path, f"f/{n}.png", (56, 56), n) for n in range(2)]
    record = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": [str(f) for f in frames],
                                      "fps": 2}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "It moves."}]}
    with pytest.raises(UserError, match="GLM-4.6V") as e:
        vision.encode_vision_record(record, glm_vp, "d.jsonl:2", base_dir=tmp_path)
    assert "<|begin_of_video|>" in str(e.value)


# ---- validate ----------------------------------------------------------------------------

# GLM-4.6V-Flash's text rotary: half of each 128-wide head, in (8, 12, 12) mRoPE sections.
FLASH_ROPE = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [8, 12, 12],
              "partial_rotary_factor": 0.5}


def test_validate_passes_glm46v_with_images(tmp_path) -> None:
    import json

    import yaml
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from longctx_cli.cli import app

    proc = write_tiny_glm46v_processor(tmp_path / "proc")
    _images(tmp_path)
    (tmp_path / "d.jsonl").write_text(json.dumps(conversation()) + "\n")
    model = AutoConfig.for_model("glm46v", text_config={"rope_parameters": FLASH_ROPE})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model_config": model.to_dict(), "processor_type": "AutoProcessor",
        "processor_path": str(proc), "sequence_len": 2048, "sequence_parallel_degree": 2,
        "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "chat_template"}]}))
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "c.yaml"),
                                      "--nproc-per-node", "2"])
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "3 images decoded" in out, out
    assert "passed: tiny random `glm46v`" in out and "images: tower split by images" in out

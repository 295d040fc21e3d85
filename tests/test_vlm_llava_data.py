"""LLaVA's vision-language data: records -> documents exactly as transformers' LlavaProcessor
makes them (CLIP's image processor, `<image>` expanded to one token per patch), packed rows
that keep each document's images, and the trainer's `[images, 3, H, W]` read back from the
cached columns. The processor is a tiny offline one (tests/vlm_fixtures.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.errors import UserError
from longctx_cli.runtime.batches import collate_images
from tests.vlm_fixtures import (
    LLAVA_IMAGE_TOKEN,
    assert_generation_prompt_is_the_processors,
    conversation,
    make_image,
    user_turn_trained,
    write_tiny_llava_processor,
)
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
SIDE, PATCH = 16, 4
TOKENS_PER_IMAGE = (SIDE // PATCH) ** 2  # CLIP's CLS feature is dropped ("default")


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return write_tiny_llava_processor(tmp_path_factory.mktemp("llava"), SIDE, PATCH)


@pytest.fixture(scope="module")
def vp(proc_dir):
    return vision.load_processor(str(proc_dir))


@pytest.fixture()
def images(tmp_path):
    # Not square and not the tower's size: CLIP resizes the short side, then crops.
    return [make_image(tmp_path, "img/a.png", (30, 20), 1),
            make_image(tmp_path, "img/b.png", (16, 16), 2),
            make_image(tmp_path, "img/c.png", (50, 18), 3)]


def test_the_folder_loads_as_a_llava_processor(proc_dir, vp):
    from transformers import AutoProcessor

    assert type(vp.processor).__name__ == "LlavaProcessor"
    assert not vp.patched and vp.image_shape == (3, SIDE, SIDE)
    assert vp.image_token == LLAVA_IMAGE_TOKEN and vp.video_token is None
    assert vp.feature_ids() == {vision.IMAGE: vp.processor.image_token_id}
    assert vision.patch_dim(vp) == 3 * SIDE * SIDE
    auto = AutoProcessor.from_pretrained(str(proc_dir), local_files_only=True)
    assert type(auto.image_processor).__name__ == "CLIPImageProcessorPil"


def test_encoding_equals_the_hf_processor(vp, tmp_path, images):
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert ref["pixel_values"].shape == (3, 3, SIDE, SIDE)
    np.testing.assert_array_equal(doc.pixel_values.reshape(-1, 3, SIDE, SIDE),
                                  ref["pixel_values"])
    # The same through `processor(text=..., images=...)`, the layout training code uses.
    from PIL import Image

    text = vp.processor.apply_chat_template(conversation()["messages"], tokenize=False)
    out = vp.processor(text=[text], images=[Image.open(p).convert("RGB") for p in images],
                       return_tensors="np")
    assert doc.input_ids == out["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values.reshape(out["pixel_values"].shape),
                                  out["pixel_values"])
    # One whole image per grid, marked (0, H, W); every placeholder one token per patch.
    assert doc.image_grid_thw == [(0, SIDE, SIDE)] * 3 and doc.media_kinds == [vision.IMAGE] * 3
    image_id = vp.processor.image_token_id
    assert doc.image_tokens == doc.input_ids.count(image_id) == 3 * TOKENS_PER_IMAGE
    assert doc.mm_token_type_ids == [int(t == image_id) for t in doc.input_ids]


def test_a_generation_prompt_equals_the_hf_processor(vp, tmp_path, images):
    assert_generation_prompt_is_the_processors(vp, tmp_path, WHERE)


def test_labels_train_the_answers_never_an_image_token(vp, tmp_path, images):
    doc = user_turn_trained(vp, tmp_path, WHERE, " A red square.</s> A cat.</s>")
    assert all(lab == IGN for lab, ty in zip(doc.labels, doc.mm_token_type_ids, strict=True)
               if ty)


def test_an_images_column_fills_llava_markers(vp, tmp_path, images):
    """The older LLaVA layout: `<image>` in the text, the images in a column."""
    record = {"messages": [{"role": "user", "content": "<image>\nWhat is in the picture?"},
                           {"role": "assistant", "content": "A cat."}],
              "images": ["img/b.png"]}
    doc = vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path)
    parts = [{"role": "user", "content": [{"type": "image", "path": "img/b.png"},
                                          {"type": "text", "text": "\nWhat is in the picture?"}]},
             {"role": "assistant", "content": "A cat."}]
    ref = hf(vp, parts, tmp_path)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values.reshape(1, 3, SIDE, SIDE),
                                  ref["pixel_values"])


def test_packed_rows_keep_each_documents_images_for_the_trainer(vp, tmp_path, images):
    """Three documents (two with images, one text-only) packed into rows, written as the
    cache's columns, read back by the trainer's collation: the row's images are the
    documents' own, in order, as `[images, 3, H, W]`."""
    from datasets import Dataset

    one = {"messages": conversation()["messages"][:2]}
    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=tmp_path)
            for i, r in enumerate((conversation(), text, one))]
    rows = vision.pack_vision_documents(docs, 512)
    assert len(rows) == 1 and sorted(rows[0].sources) == ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"]
    row = rows[0]
    order = [int(s.split(":")[1]) - 1 for s in row.sources]
    assert row.image_counts == [len(docs[i].image_grid_thw) for i in order]
    table = Dataset(vision.rows_table(rows))
    media = collate_images(table)
    assert media is not None and media.image_grid_thw is None
    want = np.concatenate([docs[i].pixel_values for i in order]).reshape(-1, 3, SIDE, SIDE)
    assert media.pixel_values.shape == (4, 3, SIDE, SIDE) and media.num_images == 4
    np.testing.assert_array_equal(media.pixel_values.numpy(), want)
    # Each document's tokens still precede its own pixels: the i-th run of image tokens in
    # the row is the i-th image.
    ids = torch.tensor(row.input_ids)
    assert int((ids == vp.processor.image_token_id).sum()) == 4 * TOKENS_PER_IMAGE
    # Text-only rows give no media.
    assert collate_images(Dataset(vision.rows_table(vision.pack_vision_documents(
        [docs[1]], 512)))) is None


def test_what_llava_cannot_take_is_refused(vp, tmp_path, images):
    video = {"messages": [{"role": "user", "content": [
        {"type": "video", "video": ["img/b.png", "img/b.png"]},
        {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "Nothing."}]}
    with pytest.raises(UserError, match="images only") as err:
        vision.encode_vision_record(video, vp, WHERE, base_dir=tmp_path)
    assert err.value.where == WHERE
    literal = copy.deepcopy(conversation())
    literal["messages"][0]["content"][1]["text"] = "Describe <image> this."
    with pytest.raises(UserError, match="placeholders for 4 image.*holds 3 image"):
        vision.encode_vision_record(literal, vp, WHERE, base_dir=tmp_path)


def test_prepared_rows_are_the_packed_documents(tmp_path, proc_dir, images):
    """`longctx preprocess`'s cached rows: the packed documents, with their images as the
    trainer reads them, and the report's image counts."""
    import json

    from longctx_cli.config.load import config_from_dict
    from longctx_cli.data.prepare import format_spec, prepare

    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    records = [conversation(), text, {"messages": conversation()["messages"][2:]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "processor_type": "AutoProcessor",
        "processor_path": str(proc_dir), "sequence_len": 128, "shuffle_merged_datasets": False,
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "datasets": [{"path": str(data), "type": "chat_template"}]})
    prepared = prepare(config, progress=False)
    vp = vision.load_config_processor(config)
    spec = format_spec(config.data.datasets[0], config, vp.tokenizer)
    docs = [vision.encode_vision_record(r, vp, f"{data}:{n + 1}", base_dir=tmp_path, spec=spec)
            for n, r in enumerate(records)]
    want = vision.pack_vision_documents(docs, config.data.sequence_len)
    assert len(want) == 2 and any(len(r.image_counts) > 1 for r in want)  # packed
    got = prepared.train.with_format("arrow")[:].to_pylist()
    assert len(got) == len(want)
    for i, (row, w) in enumerate(zip(got, want, strict=True)):
        assert (row["input_ids"], row["labels"], row["position_ids"]) == (
            w.input_ids, w.labels, w.position_ids)
        assert row["pixel_dim"] == 3 * SIDE * SIDE
        assert row["image_grid_thw"] == [[0, SIDE, SIDE]] * len(w.image_grid_thw)
        media = collate_images(prepared.train.select([i]))
        assert media is not None and media.image_grid_thw is None
        np.testing.assert_array_equal(media.pixel_values.numpy(),
                                      w.pixel_values.reshape(-1, 3, SIDE, SIDE))
    report = prepared.report
    assert report.train.images == 5 and report.train.image_tokens == 5 * TOKENS_PER_IMAGE
    assert f"{LLAVA_IMAGE_TOKEN}x{TOKENS_PER_IMAGE}" in str(report)


def test_generate_reads_a_prompts_images_as_the_tower_takes_them(proc_dir, tmp_path, images):
    """`longctx generate`'s prompt record gives the tower `[images, 3, H, W]` equal to the HF
    processor's pixel_values (flat rows with `(0, H, W)` grids would be wrong)."""
    import json

    from longctx_cli.config import config_from_dict
    from longctx_cli.eval.generate import vision_prompt

    first = {"messages": conversation()["messages"][:1]}
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "processor_type": "AutoProcessor",
        "processor_path": str(proc_dir), "tokenizer": str(proc_dir),
        "datasets": [{"path": "unused.jsonl", "type": "chat_template"}]})
    ids, media = vision_prompt(vision.load_config_processor(config), json.dumps(first), tmp_path)
    ref = hf(vision.load_processor(str(proc_dir)), first["messages"], tmp_path,
             add_generation_prompt=True)
    assert ids == ref["input_ids"][0].tolist()
    assert media.image_grid_thw is None
    torch.testing.assert_close(media.pixel_values, torch.as_tensor(ref["pixel_values"]))

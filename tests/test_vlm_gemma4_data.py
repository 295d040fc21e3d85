"""Gemma 4's vision-language data: records -> documents -> rows exactly as transformers'
Gemma4Processor makes them (its image placeholder expanded to `<|image>` + one soft token
per pooled 2 x 2 patches + `<image|>`, each image resized to its own patch grid), the
markers never trained, and the rows read back as the processor's `pixel_values` and
`image_position_ids` (padded to the row's most patches, not to the processor's budget).
The processor is a tiny offline one (tests/vlm_fixtures.py), built without torchvision as an
image-only `Gemma4Processor`. The model side under SP is tests/test_vlm_gemma4.py's; a
`longctx train` on these rows is tests/test_vlm_train.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.errors import UserError
from longctx_cli.runtime.batches import collate_images
from tests.vlm_fixtures import (
    GEMMA4_MEDIA_TOKENS,
    conversation,
    make_image,
    user_turn_trained,
    write_tiny_gemma4_processor,
)
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
PATCH, POOL, BUDGET = 2, 2, 70  # 2-pixel patches pooled 2 x 2, at most 70 tokens per image
SIZES = {"a": (40, 24), "b": (32, 32), "c": (20, 50)}  # (width, height): three patch grids


@pytest.fixture(scope="module")
def vp(tmp_path_factory):
    folder = write_tiny_gemma4_processor(tmp_path_factory.mktemp("gemma4"), PATCH, POOL, BUDGET)
    return vision.load_processor(str(folder))


@pytest.fixture()
def images(tmp_path):
    return [make_image(tmp_path / "img", f"{name}.png", size, seed)
            for seed, (name, size) in enumerate(SIZES.items())]


def _real(positions: np.ndarray) -> list[int]:
    """Each image's patches that are not padding."""
    return [int(n) for n in (positions[..., 0] >= 0).sum(-1)]


def test_encoding_equals_the_hf_processor(vp, tmp_path, images):
    assert type(vp.processor).__name__ == "ImageOnlyGemma4Processor"
    assert type(vp.image_processor).__name__ == "Gemma4ImageProcessorPil"
    assert vp.positioned and not vp.patched and not vp.sized
    assert vp.family is not None and vp.family.name == "Gemma 4"
    soft = vp.tokenizer.convert_tokens_to_ids(GEMMA4_MEDIA_TOKENS["image_token"])
    assert vp.feature_ids()[vision.IMAGE] == soft

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert doc.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
    budget = BUDGET * POOL ** 2
    assert ref["pixel_values"].shape == (3, budget, 3 * PATCH ** 2)
    counts = _real(ref["image_position_ids"])
    assert len(set(counts)) == 3 and max(counts) < budget  # three sizes, all padded
    # Each image is stored as its own patches only, with its patch grid (h, w).
    np.testing.assert_array_equal(
        doc.pixel_values, np.concatenate([p[:n] for p, n in zip(ref["pixel_values"], counts,
                                                                  strict=True)]))
    assert [h * w for _, h, w in doc.image_grid_thw] == counts
    assert all(t == -1 for t, _, _ in doc.image_grid_thw)
    assert doc.image_tokens == doc.input_ids.count(soft) == sum(counts) // POOL ** 2
    # Each image is its markers around one run of soft tokens, as the processor writes it.
    text = vp.tokenizer.decode(doc.input_ids)
    for n in counts:
        one = (GEMMA4_MEDIA_TOKENS["boi_token"] + GEMMA4_MEDIA_TOKENS["image_token"]
               * (n // POOL ** 2) + GEMMA4_MEDIA_TOKENS["eoi_token"])
        assert text.count(one) == counts.count(n)
    assert text.startswith("<bos><start_of_turn>user\n")


def test_rows_read_back_as_the_processors_pixels_and_positions(vp, tmp_path, images):
    """A packed row of two image documents and a text one reads back as the processor's
    `pixel_values` and `image_position_ids` of the row's images, in row order, padded to the
    row's most patches: the processor's own padding beyond that is padding only."""
    from datasets import Dataset

    one = {"messages": conversation()["messages"][:2]}
    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    records = (conversation(), text, one)
    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=tmp_path)
            for i, r in enumerate(records)]
    (row,) = vision.pack_vision_documents(docs, 1024)
    order = [int(s.split(":")[1]) - 1 for s in row.sources]
    refs = [hf(vp, records[i]["messages"], tmp_path) for i in order if i != 1]
    pixels = np.concatenate([r["pixel_values"] for r in refs])
    positions = np.concatenate([r["image_position_ids"] for r in refs])
    most = max(_real(positions))
    assert (positions[:, most:] == -1).all() and (pixels[:, most:] == 0).all()

    media = collate_images(Dataset(vision.rows_table([row])))
    assert media is not None and media.image_grid_thw is None
    np.testing.assert_array_equal(media.patch_positions.numpy(), positions[:, :most])
    np.testing.assert_array_equal(media.pixel_values.numpy(), pixels[:, :most])
    assert media.patches_per_image() == _real(positions)
    assert row.input_ids == [t for i in order for t in
                             (docs[i].input_ids)]  # the documents' ids, in row order


def test_the_rows_padding_gives_the_towers_own_features(vp, tmp_path, images):
    """The tower's features of the row's images padded to the row's most patches are those
    of the processor's own output, padded to its whole budget (the pooler's slots past an
    image's own are dropped either way)."""
    from datasets import Dataset
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    media = collate_images(Dataset(vision.rows_table(vision.pack_vision_documents([doc],
                                                                                  1024))))
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(
        text_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "vocab_size": 448},
        vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                       "patch_size": PATCH, "pooling_kernel_size": POOL,
                       "position_embedding_size": 32}))
    with torch.no_grad():
        own = model.get_image_features(torch.from_numpy(ref["pixel_values"]),
                                       torch.from_numpy(ref["image_position_ids"]),
                                       return_dict=True).pooler_output
        ours = model.get_image_features(media.pixel_values, media.patch_positions,
                                        return_dict=True).pooler_output
    assert [len(f) for f in ours] == [len(f) for f in own] == [
        n // POOL ** 2 for n in _real(ref["image_position_ids"])]
    for a, b in zip(ours, own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_generation_prompt_equals_the_hf_processor(vp, tmp_path, images):
    first = {"messages": conversation()["messages"][:1]}
    doc = vision.encode_vision_prompt(first, vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, first["messages"], tmp_path, add_generation_prompt=True)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    (n,) = _real(ref["image_position_ids"])
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"][0, :n])


def test_markers_and_soft_tokens_are_never_targets(vp, tmp_path, images):
    doc = user_turn_trained(vp, tmp_path, WHERE,
                            "A red square.<end_of_turn>A cat.<end_of_turn>")
    trained = vp.tokenizer.decode([lab for lab in doc.labels if lab != IGN])
    assert not any(GEMMA4_MEDIA_TOKENS[k] in trained
                   for k in ("boi_token", "eoi_token", "image_token"))


def test_videos_and_audio_are_refused(vp, tmp_path, images):
    frames = [str(make_image(tmp_path / "img", f"v{i}.png", (32, 32), 10 + i))
              for i in range(2)]
    record = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": 2},
                                     {"type": "text", "text": "Describe this image."}]},
        {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(UserError, match="Gemma 4's video frames"):
        vision.encode_vision_record(record, vp, WHERE, base_dir=Path(tmp_path))
    record["messages"][0]["content"][0] = {"type": "audio", "path": "a.wav"}  # nor audio
    with pytest.raises(UserError, match="unknown part type 'audio'"):
        vision.encode_vision_record(record, vp, WHERE, base_dir=Path(tmp_path))

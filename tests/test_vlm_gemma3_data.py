"""Gemma 3's vision-language data: records -> documents exactly as transformers'
Gemma3Processor makes them (its begin-of-image placeholder expanded to `\\n\\n<boi>` +
`image_seq_length` soft tokens + `<eoi>\\n\\n`, SigLIP-sized whole images), the markers never
trained, rows read back as `[images, 3, H, W]`, and the documents accepted by the model's own
forward (each image's soft tokens match its features). The processor is a tiny offline one
(tests/vlm_fixtures.py). The model side under SP is runtime/'s; this is the data side only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.runtime.batches import collate_images
from tests.vlm_fixtures import (
    GEMMA3_IMAGE_TOKENS,
    assert_generation_prompt_is_the_processors,
    conversation,
    user_turn_trained,
    write_tiny_gemma3_processor,
)
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
SIDE, SOFT_TOKENS, PATCH = 32, 16, 4  # 8x8 patches pooled to 4x4 soft tokens


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return write_tiny_gemma3_processor(tmp_path_factory.mktemp("gemma3"), SIDE, SOFT_TOKENS)


@pytest.fixture(scope="module")
def vp(proc_dir):
    return vision.load_processor(str(proc_dir))


@pytest.fixture()
def images(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for name, (w, h) in (("a", (40, 24)), ("b", (32, 32)), ("c", (20, 50))):
        path = tmp_path / "img" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_encoding_equals_the_hf_processor(vp, tmp_path, images):
    assert type(vp.processor).__name__ == "Gemma3Processor"
    assert type(vp.image_processor).__name__ == "Gemma3ImageProcessorPil"
    assert not vp.patched and vp.image_shape == (3, SIDE, SIDE)
    # The template writes the begin-of-image token; the features go to the soft tokens.
    assert vp.image_token == GEMMA3_IMAGE_TOKENS["boi_token"]
    soft = vp.tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["image_token"])
    assert vp.feature_ids() == {vision.IMAGE: soft}

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert doc.mm_token_type_ids == ref["token_type_ids"][0].tolist()
    assert ref["pixel_values"].shape == (3, 3, SIDE, SIDE)
    np.testing.assert_array_equal(doc.pixel_values.reshape(-1, 3, SIDE, SIDE),
                                  ref["pixel_values"])
    assert doc.image_grid_thw == [(0, SIDE, SIDE)] * 3
    assert doc.image_tokens == doc.input_ids.count(soft) == 3 * SOFT_TOKENS
    # Each image is its markers around one run of soft tokens, as the processor writes it.
    text = vp.tokenizer.decode(doc.input_ids)
    one = ("\n\n" + GEMMA3_IMAGE_TOKENS["boi_token"] + GEMMA3_IMAGE_TOKENS["image_token"]
           * SOFT_TOKENS + GEMMA3_IMAGE_TOKENS["eoi_token"] + "\n\n")
    assert text.count(one) == 3 and text.startswith("<bos><start_of_turn>user\n")


def test_a_generation_prompt_equals_the_hf_processor(vp, tmp_path, images):
    assert_generation_prompt_is_the_processors(vp, tmp_path, WHERE)


def test_markers_and_soft_tokens_are_never_targets(vp, tmp_path, images):
    doc = user_turn_trained(vp, tmp_path, WHERE,
                            "A red square.<end_of_turn>A cat.<end_of_turn>")
    trained = vp.tokenizer.decode([lab for lab in doc.labels if lab != IGN])
    assert not any(token in trained for token in GEMMA3_IMAGE_TOKENS.values())


def test_rows_read_back_as_images_the_model_takes(vp, tmp_path, images):
    """Packed rows give the trainer each document's images as `[images, 3, H, W]`; each
    document through a tiny Gemma 3's own forward (its soft-token count is checked against
    the tower's features there) gives a finite loss."""
    from datasets import Dataset
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    one = {"messages": conversation()["messages"][:2]}
    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=tmp_path)
            for i, r in enumerate((conversation(), text, one))]
    (row,) = vision.pack_vision_documents(docs, 512)
    order = [int(s.split(":")[1]) - 1 for s in row.sources]
    media = collate_images(Dataset(vision.rows_table([row])))
    assert media is not None and media.image_grid_thw is None
    np.testing.assert_array_equal(
        media.pixel_values.numpy(),
        np.concatenate([docs[i].pixel_values for i in order]).reshape(-1, 3, SIDE, SIDE))

    tok = vp.tokenizer
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=448, pad_token_id=0,
            eos_token_id=1, bos_token_id=2),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         image_size=SIDE, patch_size=PATCH),
        mm_tokens_per_image=SOFT_TOKENS,
        image_token_index=tok.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["image_token"]),
        boi_token_index=tok.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["boi_token"]),
        eoi_token_index=tok.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["eoi_token"])))
    for doc in docs:
        ids = torch.tensor([doc.input_ids])
        kwargs = {}
        if doc.image_grid_thw:
            kwargs = {"pixel_values": torch.from_numpy(doc.pixel_values).view(-1, 3, SIDE, SIDE),
                      "token_type_ids": torch.tensor([doc.mm_token_type_ids])}
        with torch.no_grad():
            loss = model(input_ids=ids, labels=torch.tensor([doc.labels]), **kwargs).loss
        assert torch.isfinite(loss)

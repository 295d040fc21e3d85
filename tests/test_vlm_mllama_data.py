"""Llama 3.2 Vision's (Mllama's) data: records -> documents exactly as transformers'
MllamaProcessor makes them (one `<|image|>` token per image, never a target; each image's
tiles padded to `max_image_tiles`, with its aspect ratio id and tile mask), rows read back as
`[images, tiles, 3, H, W]`, and a packed row of them trained through longctx's forward equal
to each document through the model's own forward with the processor's own outputs
(`pixel_values`, `aspect_ratio_ids`, `aspect_ratio_mask` and its `cross_attention_mask`,
which longctx rebuilds per document from the tokens). The processor is a tiny offline one
(tests/vlm_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.runtime.batches import collate_images
from tests.vlm_fixtures import (
    MLLAMA_IMAGE_TOKEN,
    assert_generation_prompt_is_the_processors,
    conversation,
    make_image,
    user_turn_trained,
    write_tiny_mllama_processor,
)
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
TILE, TILES = 8, 4


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return write_tiny_mllama_processor(tmp_path_factory.mktemp("mllama"), TILE, TILES)


@pytest.fixture(scope="module")
def vp(proc_dir):
    return vision.load_processor(str(proc_dir))


@pytest.fixture()
def images(tmp_path):
    # 4, 1 and 3 tiles: wide, small and tall images.
    return [make_image(tmp_path, f"img/{n}.png", size, seed) for seed, (n, size) in
            enumerate((("a", (40, 24)), ("b", (8, 8)), ("c", (10, 30))))]


def test_encoding_equals_the_hf_processor(vp, tmp_path, images):
    assert type(vp.processor).__name__ == "MllamaProcessor"
    assert type(vp.image_processor).__name__ == "MllamaImageProcessorPil"
    assert vp.tiled and vp.family.name == "Llama 3.2 Vision"
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    assert doc.input_ids == ref["input_ids"][0].tolist()
    image = vp.tokenizer.convert_tokens_to_ids(MLLAMA_IMAGE_TOKEN)
    assert doc.input_ids.count(image) == doc.image_tokens == 3  # one token per image
    assert ref["pixel_values"].shape == (1, 3, TILES, 3, TILE, TILE)
    np.testing.assert_array_equal(doc.pixel_values.reshape(3, TILES, 3, TILE, TILE),
                                  ref["pixel_values"][0])
    ratios = ref["aspect_ratio_ids"][0].tolist()
    own = ref["aspect_ratio_mask"][0].sum(-1).tolist()
    assert doc.image_grid_thw == [(-2, r, n) for r, n in zip(ratios, own, strict=True)]
    assert own == [4, 1, 3]


def test_a_generation_prompt_equals_the_hf_processor(vp, tmp_path, images):
    assert_generation_prompt_is_the_processors(vp, tmp_path, WHERE)


def test_the_image_token_is_never_a_target(vp, tmp_path, images):
    doc = user_turn_trained(vp, tmp_path, WHERE, "A red square.<|eot_id|>A cat.<|eot_id|>")
    assert MLLAMA_IMAGE_TOKEN not in vp.tokenizer.decode([t for t in doc.labels if t != IGN])


def _model(vp, attn: str = "eager"):
    """The tiny Mllama of tests/vlm_models.py with the tokenizer's vocabulary and image id."""
    from tests.vlm_models import _config, tiny_vlm

    config = _config("mllama")
    config.text_config.vocab_size = 448
    config.image_token_id = vp.tokenizer.convert_tokens_to_ids(MLLAMA_IMAGE_TOKEN)
    return tiny_vlm("mllama", attn, config)


def test_rows_train_as_the_model_does_with_the_processors_outputs(vp, tmp_path, images):
    """A packed row (two image records, a text record between them) read back from the rows
    and trained through longctx's forward (sp 1) gives the loss and every gradient of each
    record through the model's own forward with the processor's own outputs."""
    from datasets import Dataset

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.meta_relay import relay_sp_meta
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.vision import VisionLanguageForward
    from tests.layouts import sp_state

    one = {"messages": conversation()["messages"][2:]}  # two images in a row, at its start
    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    records = (conversation(), text, one)
    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=tmp_path)
            for i, r in enumerate(records)]
    (row,) = vision.pack_vision_documents(docs, 512)
    order = [int(s.split(":")[1]) - 1 for s in row.sources]
    table = Dataset(vision.rows_table([row]))
    media = collate_images(table)
    refs = [hf(vp, records[i]["messages"], tmp_path) if docs[i].image_grid_thw else None
            for i in order]
    own = [r for r in refs if r is not None]
    np.testing.assert_array_equal(media.pixel_values.numpy(), np.concatenate(
        [r["pixel_values"][0] for r in own]))
    np.testing.assert_array_equal(media.tile_mask.numpy(), np.concatenate(
        [r["aspect_ratio_mask"][0] for r in own]))

    reference = _model(vp)
    counts = [sum(lab != IGN for lab in docs[i].labels[1:]) for i in order]
    for i, ref, n in zip(order, refs, counts, strict=True):
        kwargs = {} if ref is None else {k: torch.as_tensor(ref[k]) for k in (
            "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")}
        loss = reference(input_ids=torch.tensor([docs[i].input_ids]),
                         labels=torch.tensor([docs[i].labels]), **kwargs).loss
        (loss * n / sum(counts)).backward()

    ours = _model(vp, register_sp_attention())
    relay_sp_meta(ours)
    vlm = VisionLanguageForward(ours)
    ids, pos, labels = (torch.tensor(table[0][k]) for k in ("input_ids", "position_ids",
                                                             "labels"))
    batch = vlm.shard(ids, pos, labels, media, sp_state(sp=1, kernel="torch"))
    head = model_head(ours.get_output_embeddings(), ours.config)
    (lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / sum(counts)).backward()
    assert batch.sp_meta.attention_calls == 2
    theirs = dict(reference.named_parameters())
    floor = 1e-4 * max(float(p.grad.norm()) for p in theirs.values() if p.grad is not None)
    for name, p in ours.named_parameters():
        want = theirs[name].grad
        if want is None:
            assert p.grad is None or float(p.grad.abs().max()) == 0, name
            continue
        err = float((p.grad - want).norm()) / max(float(want.norm()), floor)
        assert err < 2e-5, (name, err)
    cross = ours.model.language_model.layers[1].cross_attn.k_proj.weight.grad
    assert float(cross.norm()) > 0

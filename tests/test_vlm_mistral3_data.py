"""Mistral 3's vision-language data: records -> documents exactly as transformers'
PixtralProcessor makes them (each image resized to multiples of a merged patch at its own
size, its placeholder expanded to rows of [IMG] broken by [IMG_BREAK] and ended by
[IMG_END]), and packed rows whose images the trainer reads back as the processor's own
`pixel_values` (zero-padded to the largest) and `image_sizes`.

transformers 5.24's `processing_pixtral` imports its torchvision image processor for one
helper (`get_resize_output_image_size`, used only to count tokens ahead of time); this CPU
install has no torchvision, so for these tests that module name is given the PIL image
processor's module, which defines the same helper. The processor's own code (`__call__`,
`replace_image_token`, `apply_chat_template`) is what runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.runtime.batches import collate_images, media_inputs
from tests.vlm_fixtures import (
    PIXTRAL_TEMPLATE,
    conversation,
    make_image,
    user_turn_trained,
    write_tiny_pixtral_processor,
)
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
PATCH, MERGE = 4, 2


@pytest.fixture(scope="module")
def vp(tmp_path_factory):
    from transformers import AutoTokenizer, PixtralImageProcessorPil

    folder = write_tiny_pixtral_processor(tmp_path_factory.mktemp("pixtral"), 40, PATCH, MERGE)
    with pytest.MonkeyPatch.context() as mp:
        import transformers.models.pixtral.image_processing_pil_pixtral as pil

        mp.setitem(sys.modules, "transformers.models.pixtral.image_processing_pixtral", pil)
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    processor = PixtralProcessor(
        image_processor=PixtralImageProcessorPil.from_pretrained(str(folder)),
        tokenizer=AutoTokenizer.from_pretrained(str(folder)), patch_size=PATCH,
        spatial_merge_size=MERGE, chat_template=PIXTRAL_TEMPLATE)
    return vision.VisionProcessor(processor)


@pytest.fixture()
def images(tmp_path) -> list[Path]:
    # Three sizes and aspect ratios: resized to 24x32, 16x16 and 16x40 pixels (multiples of
    # a merged patch, 8 pixels, the longest edge at most 40).
    return [make_image(tmp_path, "img/a.png", (30, 20), 1),
            make_image(tmp_path, "img/b.png", (16, 16), 2),
            make_image(tmp_path, "img/c.png", (50, 18), 3)]


def _media(doc) -> torch.Tensor:
    return media_inputs(torch.from_numpy(doc.pixel_values), doc.image_grid_thw,
                        doc.media_kinds, doc.second_per_grid_ts)


def test_the_processor_keeps_each_images_size(vp):
    assert vp.sized and not vp.patched and vp.image_token == "[IMG]"
    assert vp.images_kwargs["patch_size"] == PATCH * MERGE  # the processor's own resize
    assert vp.feature_ids() == {vision.IMAGE: vp.processor.image_token_id}
    assert vision.patch_dim(vp) == 3  # one row per pixel: images of any size share a row


def test_encoding_equals_the_hf_processor(vp, tmp_path, images):
    from PIL import Image

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    text = vp.processor.apply_chat_template(conversation()["messages"], tokenize=False)
    out = vp.processor(text=[text], images=[Image.open(p).convert("RGB") for p in images],
                       return_tensors="np")
    for want in (ref, out):
        assert doc.input_ids == want["input_ids"][0].tolist()
        media = _media(doc)
        np.testing.assert_array_equal(media.image_sizes.numpy(), want["image_sizes"])
        np.testing.assert_array_equal(media.pixel_values.numpy(), want["pixel_values"])
    assert [tuple(s) for s in ref["image_sizes"].tolist()] == [(24, 32), (16, 16), (16, 40)]
    assert doc.image_grid_thw == [(0, 24, 32), (0, 16, 16), (0, 16, 40)]
    # One [IMG] per merged patch; rows broken by [IMG_BREAK], each image ended by [IMG_END].
    tok = vp.tokenizer
    image_id, brk, end = (tok.convert_tokens_to_ids(t) for t in
                          ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    merged = [(h // 8) * (w // 8) for h, w in ((24, 32), (16, 16), (16, 40))]
    assert doc.image_tokens == doc.input_ids.count(image_id) == sum(merged)
    assert doc.input_ids.count(end) == 3 and doc.input_ids.count(brk) == 3 + 2 + 2 - 3
    assert doc.mm_token_type_ids == [int(t == image_id) for t in doc.input_ids]


def test_labels_train_the_answers_never_an_image_token(vp, tmp_path, images):
    doc = user_turn_trained(vp, tmp_path, WHERE, "A red square.</s>A cat.</s>")
    markers = {vp.tokenizer.convert_tokens_to_ids(t)
               for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
    assert not markers & {lab for lab in doc.labels if lab != IGN}


def test_packed_rows_give_the_trainer_the_processors_pixels_and_sizes(vp, tmp_path, images):
    """Three documents (two with images, one text-only) packed into one row, written as the
    cache's columns, read back by the trainer's collation: the row's images are the
    processor's own batch of them (zero-padded to the row's largest), with their sizes."""
    from datasets import Dataset
    from PIL import Image

    one = {"messages": conversation()["messages"][:2]}
    text = {"messages": [{"role": "user", "content": "Describe this image."},
                         {"role": "assistant", "content": "The image is a red square."}]}
    records = (conversation(), text, one)
    docs = [vision.encode_vision_record(r, vp, f"d.jsonl:{i + 1}", base_dir=tmp_path)
            for i, r in enumerate(records)]
    rows = vision.pack_vision_documents(docs, 512)
    assert len(rows) == 1
    order = [int(s.split(":")[1]) - 1 for s in rows[0].sources]
    media = collate_images(Dataset(vision.rows_table(rows)))
    paths = {0: images, 1: [], 2: images[:1]}
    batch = [Image.open(p).convert("RGB") for i in order for p in paths[i]]
    want = vp.image_processor(images=batch, return_tensors="np", patch_size=PATCH * MERGE)
    assert media is not None and media.num_images == 4
    np.testing.assert_array_equal(media.image_sizes.numpy(), want["image_sizes"])
    np.testing.assert_array_equal(media.pixel_values.numpy(), want["pixel_values"])
    # Each image's [IMG] run in the row is its features' count, in row order.
    ids = torch.tensor(rows[0].input_ids)
    merged = (media.image_sizes // (PATCH * MERGE)).prod(-1)
    assert int((ids == vp.processor.image_token_id).sum()) == int(merged.sum())


def test_without_torchvision_loading_says_what_transformers_needs(tmp_path):
    """transformers' PixtralProcessor cannot be imported without torchvision: loading the
    folder then says so (not that longctx prepares no such data)."""
    import importlib.util

    from longctx_cli.errors import UserError

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor loads")
    folder = write_tiny_pixtral_processor(tmp_path / "p")
    with pytest.raises(UserError, match="PixtralProcessor needs torchvision") as e:
        vision.load_processor(str(folder))
    assert "pip install torchvision" in e.value.fix


def test_a_prepared_row_trains_as_the_model_does_on_the_processors_output(vp, tmp_path,
                                                                          images):
    """The record's prepared row, read back as the trainer reads it, through longctx's
    forward (sp 1) gives the loss and gradients of Mistral3ForConditionalGeneration on the
    processor's own `input_ids`, `pixel_values` and `image_sizes`."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, Mistral3Config

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.parallel.mesh import ParallelState
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.vision import VisionLanguageForward

    config = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                     "num_key_value_heads": 2, "vocab_size": len(vp.tokenizer),
                     "sliding_window": None, "pad_token_id": 0},
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16,
                       "patch_size": PATCH, "image_size": 64},
        image_token_index=vp.processor.image_token_id, spatial_merge_size=MERGE)

    def build(attn: str):
        torch.manual_seed(0)
        return AutoModelForImageTextToText.from_config(
            config, attn_implementation={"": attn, "text_config": attn, "vision_config": "sdpa"},
            dtype=torch.float32).train()

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    row = vision.pack_vision_documents([doc], 512)[0]
    media = collate_images(Dataset(vision.rows_table([row])))
    ref = hf(vp, conversation()["messages"], tmp_path)
    labels = torch.tensor(doc.labels)
    reference = build("eager")
    ref_loss = reference(input_ids=torch.as_tensor(ref["input_ids"]), labels=labels[None],
                         pixel_values=torch.as_tensor(ref["pixel_values"]),
                         image_sizes=torch.as_tensor(ref["image_sizes"])).loss
    ref_loss.backward()
    ours = build(register_sp_attention())
    vlm = VisionLanguageForward(ours)
    batch = vlm.shard(torch.tensor(row.input_ids), torch.tensor(row.position_ids),
                      torch.tensor(row.labels), media, ParallelState())
    count = int((labels[1:] != IGN).sum())
    head = model_head(ours.get_output_embeddings(), ours.config)
    loss = lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / count
    loss.backward()
    want = float(ref_loss.detach())
    assert abs(float(loss.detach()) - want) / want < 2e-5
    mine = dict(ours.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is None:
            assert mine[name].grad is None or not mine[name].grad.any(), name
            continue
        err = float((mine[name].grad - p.grad).norm()) / max(float(p.grad.norm()), 1e-6)
        assert err < 2e-5, (name, err)
    assert any("vision_tower" in n and p.grad is not None and p.grad.any()
               for n, p in reference.named_parameters())

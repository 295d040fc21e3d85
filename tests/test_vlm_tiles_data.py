"""Tiled processors' rows (SmolVLM, InternVL): records -> documents exactly as
transformers' own processor makes them (each image cut into tiles plus a thumbnail: SmolVLM
writes each tile's placeholders after its `<fake_token_around_image><row_r_col_c>` markers,
InternVL an image's between `<img>` and `</img>`), images of different sizes so their tile
counts differ, packed rows that keep each document's tiles, and a prepared row through
longctx's forward equal to the model's own forward on the processor's output. The
processors are tiny offline ones (tests/vlm_fixtures.py), built without torchvision or
num2words (their video parts only) where those are missing."""

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
from tests.vlm_fixtures import conversation, make_image
from tests.vlm_fixtures import hf_chat as hf

WHERE = "data/d.jsonl:3"
TILE, PATCH, SCALE = 16, 4, 2
PER_TILE = (TILE // PATCH) ** 2 // SCALE**2  # 4 tokens per tile after the pixel shuffle
FAMILIES = ("smolvlm", "internvl")
# Per family: each image's tiles (its thumbnail counted), the markers the processor writes,
# the end of its answers.
# SmolVLM resizes to a 48-pixel longest edge, then to whole 16-pixel tiles: 2 x 3, 3 x 3 and
# 2 x 3 tiles, each with its thumbnail. InternVL picks the grid of at most 6 tiles nearest
# each image's aspect ratio: 2 x 1 and 3 x 2 with thumbnails; the square one is one tile.
TILES = {"smolvlm": [7, 10, 7], "internvl": [3, 1, 7]}
MARKERS = {"smolvlm": ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>"),
           "internvl": ("<img>", "</img>")}
END = {"smolvlm": "<end_of_utterance>", "internvl": "<|im_end|>"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory, family) -> Path:
    from tests import vlm_fixtures

    folder = tmp_path_factory.mktemp(family)
    if family == "smolvlm":
        return vlm_fixtures.write_tiny_smolvlm_processor(folder, TILE, PATCH, SCALE)
    return vlm_fixtures.write_tiny_internvl_processor(folder, TILE, PER_TILE)


@pytest.fixture(scope="module")
def vp(proc_dir):
    return vision.load_processor(str(proc_dir))


@pytest.fixture()
def images(tmp_path):
    return [make_image(tmp_path, "img/a.png", (40, 20), 1),
            make_image(tmp_path, "img/b.png", (12, 12), 2),
            make_image(tmp_path, "img/c.png", (50, 30), 3)]


def _tiles(vp, path: Path) -> int:
    from PIL import Image

    out = vp.image_processor(images=[Image.open(path).convert("RGB")], return_tensors="np",
                             **vp.images_kwargs)
    return int(np.asarray(out["pixel_values"]).shape[-4])


def test_the_folder_loads_as_its_processor(vp, family, images) -> None:
    name = {"smolvlm": "SmolVLMProcessor", "internvl": "InternVLProcessor"}[family]
    assert type(vp.processor).__name__.endswith(name)
    assert not vp.patched and vp.image_shape == (3, TILE, TILE)
    assert vp.feature_ids()[vision.IMAGE] == vp.processor.image_token_id
    assert [_tiles(vp, p) for p in images] == TILES[family]  # the tile counts differ


def test_encoding_equals_the_hf_processor(vp, family, tmp_path, images) -> None:
    from PIL import Image

    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], tmp_path)
    tiles = sum(TILES[family])
    assert doc.input_ids == ref["input_ids"][0].tolist()
    shape = ((1,) if family == "smolvlm" else ()) + (tiles, 3, TILE, TILE)
    assert ref["pixel_values"].shape == shape
    np.testing.assert_array_equal(doc.pixel_values.reshape(shape), ref["pixel_values"])
    if family == "smolvlm":
        assert np.asarray(ref["pixel_attention_mask"]).all()  # whole tiles: no mask to keep
    # The same through `processor(text=..., images=...)`, the layout training code uses.
    text = vp.processor.apply_chat_template(conversation()["messages"], tokenize=False)
    out = vp.processor(text=[text], images=[[Image.open(p).convert("RGB") for p in images]],
                       return_tensors="np")
    assert doc.input_ids == out["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values.reshape(out["pixel_values"].shape),
                                  out["pixel_values"])
    # One row per tile (grid (0, H, W)), PER_TILE placeholders each, after its markers.
    assert doc.image_grid_thw == [(0, TILE, TILE)] * tiles
    image_id = vp.processor.image_token_id
    assert doc.image_tokens == doc.input_ids.count(image_id) == tiles * PER_TILE
    assert doc.mm_token_type_ids == [int(t == image_id) for t in doc.input_ids]
    rendered = vp.tokenizer.decode(doc.input_ids)
    if family == "smolvlm":
        assert rendered.count("<row_2_col_3>") == 3 and rendered.count("<global-img>") == 3
    else:
        assert rendered.count("<img>") == rendered.count("</img>") == 3


def test_labels_train_the_answers_never_an_image_or_tile_token(vp, family, tmp_path,
                                                               images) -> None:
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    targets = [t for t, lab in zip(doc.input_ids, doc.labels, strict=True) if lab != IGN]
    answers = vp.tokenizer.decode(targets)
    assert answers.replace(" ", "") == f"Aredsquare.{END[family]}Acat.{END[family]}", answers
    trained_user = copy.deepcopy(conversation())
    trained_user["messages"][2]["training"] = True  # text, then its two images
    doc = vision.encode_vision_record(trained_user, vp, WHERE, base_dir=tmp_path)
    trained = vp.tokenizer.decode([lab for lab in doc.labels if lab != IGN])
    assert "And these?" in trained
    for marker in (vp.image_token, *MARKERS[family]):
        assert marker not in trained, marker


def test_a_video_is_refused(vp, tmp_path, images) -> None:
    video = {"messages": [{"role": "user", "content": [
        {"type": "video", "video": ["img/b.png", "img/b.png"]},
        {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "Nothing."}]}
    with pytest.raises(UserError, match="images only"):
        vision.encode_vision_record(video, vp, WHERE, base_dir=tmp_path)


def test_a_prepared_row_trains_as_the_models_own_forward(vp, family, tmp_path,
                                                         images) -> None:
    """Two documents packed into one row, read back by the trainer's collation, through
    longctx's rebuilt forward (sp 1): the loss and every gradient equal the model's own
    forward on the processor's `input_ids`, `pixel_values` and `pixel_attention_mask`,
    document by document."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText

    from longctx_cli.parallel.attention import register_sp_attention
    from longctx_cli.runtime.head import model_head
    from longctx_cli.runtime.loss import lm_loss_sum
    from longctx_cli.runtime.vision import VisionLanguageForward
    from tests.layouts import sp_state

    records = [conversation(), {"messages": conversation()["messages"][2:]}]
    docs = [vision.encode_vision_record(r, vp, f"d:{i}", base_dir=tmp_path)
            for i, r in enumerate(records)]
    rows = vision.pack_vision_documents(docs, 1024)
    assert len(rows) == 1
    table = Dataset(vision.rows_table(rows))
    media = collate_images(table)
    assert media.num_images == sum(TILES[family]) + sum(TILES[family][1:])

    def build(attn: str):
        torch.manual_seed(0)
        text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=len(vp.tokenizer), pad_token_id=0)
        tower = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=2, image_size=TILE, patch_size=PATCH)
        if family == "smolvlm":
            from transformers import LlamaConfig, SmolVLMConfig

            config = SmolVLMConfig(vision_config=tower, text_config=LlamaConfig(**text),
                                   scale_factor=SCALE, image_token_id=vp.processor.image_token_id)
        else:
            from transformers import InternVLConfig, Qwen2Config

            config = InternVLConfig(vision_config=tower, text_config=Qwen2Config(**text),
                                    downsample_ratio=1 / SCALE,
                                    image_token_id=vp.processor.image_token_id)
        return AutoModelForImageTextToText.from_config(
            config, attn_implementation={"": attn, "text_config": attn,
                                         "vision_config": "sdpa"}).train()

    reference = build("eager")
    counts = [sum(lab != IGN for lab in d.labels[1:]) for d in docs]
    for record, doc, n in zip(records, docs, counts, strict=True):
        out = hf(vp, record["messages"], tmp_path)  # the processor's own inputs
        ids = torch.as_tensor(out["input_ids"])
        assert ids[0].tolist() == doc.input_ids  # so the document's labels are theirs
        pixels = {k: torch.as_tensor(out[k]) for k in ("pixel_values", "pixel_attention_mask")
                  if k in out}
        loss = reference(input_ids=ids, labels=torch.tensor(doc.labels)[None], **pixels).loss
        (loss * n / sum(counts)).backward()
    ours = build(register_sp_attention())
    ours.load_state_dict(reference.state_dict())
    vlm = VisionLanguageForward(ours)
    row = rows[0]
    batch = vlm.shard(torch.tensor(row.input_ids), torch.tensor(row.position_ids),
                      torch.tensor(row.labels), media, sp_state(sp=1, kernel="torch"))
    head = model_head(ours.get_output_embeddings(), ours.config)
    (lm_loss_sum(head, vlm.hidden_states(batch), batch.shift_labels) / sum(counts)).backward()
    ref = dict(reference.named_parameters())
    floor = 1e-4 * max(float(p.grad.norm()) for p in ref.values() if p.grad is not None)
    for name, p in ours.named_parameters():
        want = ref[name].grad
        if want is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        err = float((p.grad - want).norm()) / max(float(want.norm()), floor)
        assert err < 2e-5, (name, err)
    assert any(("vision_model" in n or "vision_tower" in n) and p.grad is not None
               and p.grad.any()
               for n, p in ours.named_parameters())

"""Vision-language data (#65): records -> documents as the Hugging Face processor makes
them, chat labels, the record layouts Axolotl users have, video frames, packing, errors."""

from __future__ import annotations

import base64
import itertools
from pathlib import Path

import numpy as np
import pytest

from longctx_cli.constants import IGNORE_INDEX as IGN
from longctx_cli.data import vision
from longctx_cli.errors import UserError
from tests.vlm_fixtures import conversation, make_image, write_tiny_qwen_vl_processor

WHERE = "data/d.jsonl:3"


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen_vl_processor(tmp_path_factory.mktemp("proc"))


@pytest.fixture(scope="module")
def vp(proc_dir):
    return vision.load_processor(str(proc_dir))


def rgb(path: Path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def hf(vp, messages, images):
    """What the Hugging Face processor itself makes of the conversation and images."""
    text = vp.processor.apply_chat_template(messages, tokenize=False)
    out = vp.processor(text=[text], images=images or None, return_mm_token_type_ids=True,
                       return_tensors="np")
    return out


@pytest.fixture()
def images(tmp_path):
    return [make_image(tmp_path, "img/a.png", (84, 56), 1),
            make_image(tmp_path, "img/b.png", (56, 56), 2),
            make_image(tmp_path, "img/c.png", (140, 70), 3)]


# ---- the processor folder ----------------------------------------------------------------


def test_processor_folder_loads_offline(proc_dir, vp):
    assert vp.image_token == "<|image_pad|>"
    assert vp.tokenizer.convert_tokens_to_ids("<|image_pad|>") == vp.processor.image_token_id
    assert vp.image_processor.merge_size == 2
    assert "<|vision_start|><|image_pad|><|vision_end|>" in vp.chat_template
    for folder in (proc_dir.parent / "absent", proc_dir.parent):
        with pytest.raises(UserError, match="processor"):
            vision.load_processor(str(folder))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return  # AutoProcessor builds Qwen's video processor, which needs torchvision
    from transformers import AutoProcessor

    auto = AutoProcessor.from_pretrained(str(proc_dir), local_files_only=True)
    assert auto.image_token_id == vp.processor.image_token_id


# ---- encoding equals the processor's -----------------------------------------------------


def test_encoding_matches_the_hf_processor(vp, tmp_path, images):
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, conversation()["messages"], [rgb(p) for p in images])
    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert doc.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
    assert doc.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])
    assert doc.image_grid_thw == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    # Three images of different shapes: 4x6, 4x4 and 4x10 patches of 14 pixels.
    assert doc.image_grid_thw == [(1, 4, 6), (1, 4, 4), (1, 4, 10)]
    assert doc.image_tokens == (24 + 16 + 40) // 4
    assert doc.media_kinds == [vision.IMAGE] * 3 and doc.source == WHERE


def test_a_generation_prompt_matches_the_hf_processor(vp, tmp_path, images):
    """`longctx generate`'s prompt: the user turn and the template's generation prompt, as
    the processor makes them with add_generation_prompt; relative paths survive a copy."""
    first = {"messages": conversation()["messages"][:1]}
    elsewhere = vision.with_absolute_paths(first, tmp_path)
    part = elsewhere["messages"][0]["content"][0]
    assert Path(part["path"]).is_absolute() and Path(part["path"]).is_file()
    doc = vision.encode_vision_prompt(elsewhere, vp, WHERE, base_dir=Path("/nonexistent"))
    text = vp.processor.apply_chat_template(first["messages"], tokenize=False,
                                            add_generation_prompt=True)
    ref = vp.processor(text=[text], images=[rgb(images[0])], return_tensors="np")
    assert doc.input_ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])


def test_labels_train_assistant_turns_only(vp, tmp_path, images):
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    tok = vp.tokenizer
    targets = [t for t, lab in zip(doc.input_ids, doc.labels, strict=True) if lab != IGN]
    assert tok.decode(targets) == "A red square.<|im_end|>A cat.<|im_end|>"
    for ty, lab in zip(doc.mm_token_type_ids, doc.labels, strict=True):
        if ty:
            assert lab == IGN
    # Every target is the token itself (labels are aligned, the trainer shifts).
    assert all(lab in (IGN, t) for t, lab in zip(doc.input_ids, doc.labels, strict=True))


def test_trained_user_turn_still_masks_its_image_tokens(vp, tmp_path, images):
    record = conversation()
    record["messages"][0]["training"] = True
    doc = vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path)
    tok = vp.tokenizer
    targets = tok.decode([t for t, lab in zip(doc.input_ids, doc.labels, strict=True)
                          if lab != IGN])
    assert targets.startswith("Describe this image.")
    assert "<|image_pad|>" not in targets and "<|vision_start|>" not in targets
    assert doc.input_ids == vision.encode_vision_record(
        conversation(), vp, WHERE, base_dir=tmp_path).input_ids


# ---- record layouts ----------------------------------------------------------------------


def test_images_column_fills_sourceless_parts_markers_or_first_user_turn(vp, tmp_path, images):
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "path": "img/a.png"},
                                     {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": "A cat."}]}
    want = vision.encode_vision_record(parts, vp, WHERE, base_dir=tmp_path)
    sourceless = {"images": ["img/a.png"], "messages": [
        {"role": "user", "content": [{"type": "image"},
                                     {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    marker = {"images": ["img/a.png"], "conversations": [
        {"from": "human", "value": "<image>What is in the picture?"},
        {"from": "gpt", "value": "A cat."}]}
    for record in (sourceless, marker):
        doc = vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path)
        assert doc.input_ids == want.input_ids and doc.labels == want.labels
        np.testing.assert_array_equal(doc.pixel_values, want.pixel_values)

    # No place for the column's images: they go at the end of the first user turn.
    appended = {"images": ["img/a.png", "img/b.png"], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is in the picture?"},
        {"role": "assistant", "content": "A cat."}]}
    doc = vision.encode_vision_record(appended, vp, WHERE, base_dir=tmp_path)
    ref = hf(vp, [appended["messages"][0],
                  {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                               {"type": "image"}, {"type": "image"}]},
                  appended["messages"][2]], [rgb(images[0]), rgb(images[1])])
    assert doc.input_ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])

    two_slots = {**sourceless, "images": ["img/a.png", "img/b.png"]}
    with pytest.raises(UserError, match=r"holds 2 image\(s\) but its messages have 1") as err:
        vision.encode_vision_record(two_slots, vp, WHERE, base_dir=tmp_path)
    assert WHERE in str(err.value)

    # Sourced image parts and a column too (exported datasets carry both): refused, not
    # appended again.
    both = {**parts, "images": ["img/a.png"]}
    with pytest.raises(UserError, match="cannot tell whether the column repeats") as err:
        vision.encode_vision_record(both, vp, WHERE, base_dir=tmp_path)
    assert WHERE in str(err.value)


def test_image_sources_path_file_url_base64_give_the_same_pixels(vp, tmp_path, images):
    raw = images[0].read_bytes()
    b64 = base64.b64encode(raw).decode()
    sources = [{"path": str(images[0])}, {"url": images[0].resolve().as_uri()},
               {"base64": b64}, {"image": f"data:image/png;base64,{b64}"},
               {"image": "img/a.png"}, {"image": {"bytes": raw, "path": None}}]
    docs = []
    for source in sources:
        record = {"messages": [{"role": "user", "content": [{"type": "image", **source},
                                                            {"type": "text", "text": "Hi"}]},
                               {"role": "assistant", "content": "A cat."}]}
        docs.append(vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path))
    for doc in docs[1:]:
        assert doc.input_ids == docs[0].input_ids
        np.testing.assert_array_equal(doc.pixel_values, docs[0].pixel_values)


def test_image_size_pads_or_resizes_before_the_processor(proc_dir, tmp_path):
    from PIL import Image, ImageOps

    path = make_image(tmp_path, "wide.png", (112, 56), 7)
    record = {"messages": [{"role": "user", "content": [{"type": "image", "path": "wide.png"}]},
                           {"role": "assistant", "content": "ok"}]}
    square = vision.load_processor(str(proc_dir), image_size=56)
    doc = vision.encode_vision_record(record, square, WHERE, base_dir=tmp_path)
    padded = ImageOps.pad(rgb(path), (56, 56), method=Image.Resampling.BILINEAR,
                          color=(0, 0, 0))
    assert np.asarray(padded)[0].max() == 0  # black bars above and below
    ref = hf(square, [{"role": "user", "content": [{"type": "image"}]},
                      {"role": "assistant", "content": "ok"}], [padded])
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])
    assert doc.image_grid_thw == [(1, 4, 4)]

    exact = vision.load_processor(str(proc_dir), image_size=[56, 112],
                                  image_resize_algorithm="LANCZOS")
    doc = vision.encode_vision_record(record, exact, WHERE, base_dir=tmp_path)
    resized = rgb(path).resize((56, 112), Image.Resampling.LANCZOS)  # (width, height)
    ref = hf(exact, [{"role": "user", "content": [{"type": "image"}]},
                     {"role": "assistant", "content": "ok"}], [resized])
    np.testing.assert_array_equal(doc.pixel_values, ref["pixel_values"])
    assert doc.image_grid_thw == [(1, 8, 4)]  # 112 high, 56 wide

    for bad in ({"image_resize_algorithm": "nearest"}, {"image_size": 0},
                {"image_size": [1, 2, 3]}):
        with pytest.raises(UserError):
            vision.load_processor(str(proc_dir), **bad)


# ---- video frames ------------------------------------------------------------------------


def test_video_frames_patch_in_time_like_the_video_processor(vp, tmp_path):
    a, b = (make_image(tmp_path, f"f/{n}.png", (84, 56), n) for n in (10, 11))
    image_a = vision.encode_vision_record(
        {"messages": [{"role": "user", "content": [{"type": "image", "path": str(a)}]},
                      {"role": "assistant", "content": "ok"}]}, vp, WHERE, base_dir=tmp_path)
    image_b = vision.encode_vision_record(
        {"messages": [{"role": "user", "content": [{"type": "image", "path": str(b)}]},
                      {"role": "assistant", "content": "ok"}]}, vp, WHERE, base_dir=tmp_path)

    def video(frames, **extra):
        record = {"messages": [
            {"role": "user", "content": [{"type": "video", "video": frames, **extra},
                                         {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": "It moves."}]}
        return vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path)

    # Pairs of equal frames are exactly images (an image is its frame repeated in time).
    doc = video(["f/10.png", "f/10.png", "f/11.png", "f/11.png"])
    assert doc.image_grid_thw == [(2, 4, 6)] and doc.media_kinds == [vision.VIDEO]
    np.testing.assert_array_equal(
        doc.pixel_values, np.concatenate([image_a.pixel_values, image_b.pixel_values]))
    assert doc.mm_token_type_ids.count(vision.VIDEO) == 2 * 4 * 6 // 4
    assert vision.IMAGE not in doc.mm_token_type_ids
    assert doc.second_per_grid_ts == [2 / vision.DEFAULT_VIDEO_FPS]
    vid = vp.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert [t for t, ty in zip(doc.input_ids, doc.mm_token_type_ids, strict=True)
            if ty == vision.VIDEO] == [vid] * 12
    assert all(lab == IGN for lab, ty in zip(doc.labels, doc.mm_token_type_ids, strict=True)
               if ty)

    # Distinct frames: time is the axis after channels in every patch (C, T, ph, pw).
    doc = video(["f/10.png", "f/11.png"], fps=2)
    patches = doc.pixel_values.reshape(24, 3, 2, 14 * 14)
    np.testing.assert_array_equal(patches[:, :, 0],
                                  image_a.pixel_values.reshape(24, 3, 2, -1)[:, :, 0])
    np.testing.assert_array_equal(patches[:, :, 1],
                                  image_b.pixel_values.reshape(24, 3, 2, -1)[:, :, 0])
    assert doc.second_per_grid_ts == [1.0]

    # An odd frame count is padded with the last frame.
    doc = video(["f/10.png", "f/11.png", "f/10.png"])
    assert doc.image_grid_thw == [(2, 4, 6)]
    last = doc.pixel_values[24:].reshape(24, 3, 2, -1)
    np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])

    with pytest.raises(UserError, match="frames") as err:
        video("clip.mp4")
    assert WHERE in str(err.value)


# ---- packing -----------------------------------------------------------------------------


def test_packing_keeps_each_documents_images_with_it_in_order(vp, tmp_path):
    docs = []
    for d, n_images in enumerate([2, 0, 1, 3, 1]):
        paths = [make_image(tmp_path, f"p/{d}_{i}.png", (56 + 28 * i, 56), 100 * d + i)
                 for i in range(n_images)]
        content = [{"type": "text", "text": f"Doc {d}." + " and more" * d}]
        content += [{"type": "image", "path": str(p)} for p in paths]
        record = {"messages": [{"role": "user", "content": content},
                               {"role": "assistant", "content": f"Answer {d}."}]}
        docs.append(vision.encode_vision_record(record, vp, f"d.jsonl:{d + 1}",
                                                base_dir=tmp_path))
    longest = max(len(d) for d in docs)
    rows = vision.pack_vision_documents(docs, longest + 40)
    assert 1 < len(rows) < len(docs)
    seen = []
    for row in rows:
        n = len(row.input_ids)
        assert n <= longest + 40
        assert len(row.labels) == len(row.position_ids) == len(row.mm_token_type_ids) == n
        starts = [t for t, p in enumerate(row.position_ids) if p == 0]
        assert len(starts) == len(row.sources) == len(row.image_counts)
        patch_at, grid_at = 0, 0
        for k, (start, source) in enumerate(zip(starts, row.sources, strict=True)):
            doc = docs[int(source.split(":")[1]) - 1]
            seen.append(source)
            end = start + len(doc)
            assert row.input_ids[start:end] == doc.input_ids
            assert row.position_ids[start:end] == list(range(len(doc)))
            assert row.mm_token_type_ids[start:end] == doc.mm_token_type_ids
            assert row.labels[start] == IGN and row.labels[start + 1:end] == doc.labels[1:]
            assert row.image_counts[k] == len(doc.image_grid_thw)
            grids = row.image_grid_thw[grid_at:grid_at + row.image_counts[k]]
            assert grids == doc.image_grid_thw
            patches = sum(t * h * w for t, h, w in grids)
            np.testing.assert_array_equal(row.pixel_values[patch_at:patch_at + patches],
                                          doc.pixel_values)
            patch_at += patches
            grid_at += row.image_counts[k]
        assert patch_at == len(row.pixel_values) and grid_at == len(row.image_grid_thw)
        # The row's image tokens are exactly its grids' merged patches, in order.
        assert row.mm_token_type_ids.count(vision.IMAGE) == sum(
            t * h * w // 4 for t, h, w in row.image_grid_thw)
    assert sorted(seen) == sorted(d.source for d in docs)


# ---- errors ------------------------------------------------------------------------------


def one_image(source: dict, text: str = "Hi") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", **source},
                                                      {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "ok"}]}


def test_bad_images_are_user_errors_naming_the_record(vp, tmp_path, images):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    cases = [
        (one_image({"path": "img/missing.png"}), "does not exist"),
        (one_image({"path": "broken.png"}), "not an image PIL can read"),
        (one_image({"url": "https://example.com/cat.png"}), "web address"),
        (one_image({"image": "http://example.com/cat.png"}), "web address"),
        (one_image({"base64": base64.b64encode(b"garbage").decode()}), "not an image"),
        (one_image({"path": "img/a.png"}, text="see <|image_pad|> here"), "placeholders for 2"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                       {"role": "assistant", "content": "ok"}]}, "no source"),
    ]
    for record, words in cases:
        with pytest.raises(UserError) as err:
            vision.encode_vision_record(record, vp, WHERE, base_dir=tmp_path)
        message = str(err.value)
        assert err.value.where == WHERE and message.startswith(WHERE), message
        assert words in message and err.value.fix, message
        assert "Traceback" not in message and "\n" not in message


def test_a_template_without_image_placeholders_is_refused(vp, tmp_path, images):
    from longctx_cli.data import formats

    spec = formats.FormatSpec("chat_template", end_markers=("<|im_end|>",), template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
        "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"))
    with pytest.raises(UserError, match=r"placeholders for 0 image\(s\).*holds 1 image") as err:
        vision.encode_vision_record(one_image({"path": "img/a.png"}), vp, WHERE,
                                    base_dir=tmp_path, spec=spec)
    assert err.value.where == WHERE


def test_a_document_longer_than_sequence_len_says_what_to_change(vp, tmp_path, images):
    doc = vision.encode_vision_record(conversation(), vp, WHERE, base_dir=tmp_path)
    with pytest.raises(UserError) as err:
        vision.pack_vision_documents([doc], len(doc) - 1)
    message = str(err.value)
    assert err.value.where == WHERE and message.startswith(WHERE)
    assert f"{doc.image_tokens} of them are image/video tokens" in message
    for knob in ("image_size", "max_pixels", "sequence_len"):
        assert knob in message
    assert len(vision.pack_vision_documents([doc], len(doc))) == 1


def test_qwen3_vl_video_frames_follow_their_timestamps_as_its_processor_writes(tmp_path):
    """Qwen3-VL writes each temporal patch of a video as its own run of tokens after a
    `<t seconds>` timestamp. The ids equal the template rendered with the video placeholder
    replaced by transformers' own `Qwen3VLProcessor.replace_video_token` (run here on a
    stand-in for its video processor, which needs torchvision), then tokenized."""
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor

    qvp = vision.load_processor(str(write_tiny_qwen_vl_processor(
        tmp_path / "proc3", 16, "Qwen3VLProcessor")))
    frames = [make_image(tmp_path, f"f/{n}.png", (64, 32), n) for n in range(3)]
    record = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": [str(f) for f in frames],
                                      "fps": 2}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "It moves."}]}
    doc = vision.encode_vision_record(record, qvp, WHERE, base_dir=tmp_path)
    assert doc.image_grid_thw == [(2, 2, 4)]  # 3 frames padded to 4: 2 temporal patches

    proc = qvp.processor
    stand_in = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        _calculate_timestamps=proc._calculate_timestamps,
        vision_start_token=proc.vision_start_token, vision_end_token=proc.vision_end_token,
        video_token=proc.video_token)
    inputs = {"video_grid_thw": [np.array([2, 2, 4])],
              "video_metadata": [SimpleNamespace(fps=2.0, frames_indices=[0, 1, 2])]}
    replacement = Qwen3VLProcessor.replace_video_token(stand_in, inputs, 0)
    assert replacement.startswith("<0.2 seconds>") and "<1.0 seconds>" in replacement
    text = proc.apply_chat_template(record["messages"], tokenize=False)
    text = text.replace(proc.video_token, replacement, 1)
    assert doc.input_ids == qvp.tokenizer(text, add_special_tokens=False)["input_ids"]
    runs = [k for k, _ in itertools.groupby(doc.mm_token_type_ids) if k]
    assert runs == [vision.VIDEO, vision.VIDEO]  # one run per temporal patch
    assert all(lab == IGN for lab, ty in zip(doc.labels, doc.mm_token_type_ids, strict=True)
               if ty)


def test_documents_read_back_from_a_slice_of_their_table():
    """A slice of the documents' Arrow table (a later chunk of prepare's file) reads back
    each document's own pixels: the list offsets index the whole child array."""
    docs = [vision.VisionDocument([1, 2], [1, 2], [0, 0],
                                  np.arange(6, dtype=np.float32).reshape(2, 3), [(1, 1, 2)],
                                  "a", [vision.IMAGE], []),
            vision.VisionDocument([3], [3], [0], np.arange(6, 12, dtype=np.float32).reshape(2, 3),
                                  [(1, 1, 2)], "b", [vision.IMAGE], [])]
    back = vision.docs_from_table(vision.docs_table(docs).slice(1))
    assert len(back) == 1 and back[0].source == "b"
    np.testing.assert_array_equal(back[0].pixel_values, docs[1].pixel_values)
